"""spmd's backend conformance suite, run against shm for world sizes 1 to 4."""

from spmd.testing.conformance import BackendConformance


class TestShmConformance(BackendConformance):
    backend = "shm"
