"""spmd's backend conformance suite, run against Gloo for world sizes 1 to 4."""

from spmd.testing.conformance import BackendConformance


class TestGlooConformance(BackendConformance):
    backend = "gloo"
