"""Tensor and sequence parallelism: styles, parallelize_module, loss_parallel (torch's names)."""

from spmd.parallel.tp.api import parallelize_module
from spmd.parallel.tp.loss import loss_parallel
from spmd.parallel.tp.prepare import PrepareModuleInput, PrepareModuleOutput
from spmd.parallel.tp.style import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

__all__ = [
    "ColwiseParallel",
    "ParallelStyle",
    "PrepareModuleInput",
    "PrepareModuleOutput",
    "RowwiseParallel",
    "SequenceParallel",
    "loss_parallel",
    "parallelize_module",
]
