"""Tensor and sequence parallelism at torch's path (``torch.distributed.tensor.parallel``).

Styles, ``parallelize_module`` and ``loss_parallel`` live here, beside the DTensor
they build on; ``spmd.parallel.tp`` re-exports them.
"""

from spmd._mirror import missing_names
from spmd.tensor.parallel.api import parallelize_module
from spmd.tensor.parallel.loss import loss_parallel
from spmd.tensor.parallel.prepare import PrepareModuleInput, PrepareModuleOutput
from spmd.tensor.parallel.style import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
)

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

#: torch.distributed.tensor.parallel names spmd does not have yet -> the closest spmd way.
MISSING = {
    "PrepareModuleInputOutput": "PrepareModuleInput(...) and PrepareModuleOutput(...) applied to the module one after "
    "the other (parallelize_module(m, mesh, PrepareModuleInput(...)); then again with PrepareModuleOutput(...))",
}

__getattr__ = missing_names(__name__, MISSING)
