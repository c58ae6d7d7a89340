"""spmd.testing: run tests on N real ranks, and the backend conformance suite.

``World`` starts N worker processes once and runs many test functions in
them; the pytest plugin (``spmd.testing.pytest_plugin``, auto-registered)
pools worlds per (backend, world size) and exposes the ``spmd_world`` fixture.
Backend plugins subclass ``BackendConformance`` to run the shared suite.
"""

from spmd.testing.world import RankFailure, World, WorldTimeout

__all__ = ["BackendConformance", "RankFailure", "World", "WorldTimeout"]


def __getattr__(name: str) -> object:
    if name == "BackendConformance":  # imports pytest; only test code needs it
        from spmd.testing.conformance import BackendConformance

        return BackendConformance
    raise AttributeError(name)
