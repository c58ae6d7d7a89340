"""The backend conformance suite: op x dtype x reduce op x size x world size x group shape x async.

Every backend plugin runs it against itself by subclassing ``BackendConformance``.
"""

from spmd.testing.conformance.suite import GROUP_SHAPES, BackendConformance, run_cases, suite_params

__all__ = ["GROUP_SHAPES", "BackendConformance", "run_cases", "suite_params"]
