"""Tensor and sequence parallelism under ``spmd.parallel`` (its home is ``spmd.tensor.parallel``)."""

from spmd.tensor import parallel as _home
from spmd.tensor.parallel import *  # noqa: F403 - the same names, one list (spmd.tensor.parallel.__all__)

__all__ = list(_home.__all__)
