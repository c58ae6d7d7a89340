"""The builtin strategies plugin: ``ddp``."""

from __future__ import annotations

from typing import Any

from torch import nn

from spmd.markers import hookimpl
from spmd.parallel.registry import StrategySpec


def apply_ddp(module: nn.Module, **options: Any) -> nn.Module:
    """Wrap ``module`` in spmd.parallel.DistributedDataParallel(module, **options)."""
    from spmd.parallel.ddp import DistributedDataParallel

    return DistributedDataParallel(module, **options)


def apply_tp(module: nn.Module, *, device_mesh: Any, parallelize_plan: Any) -> nn.Module:
    """spmd.parallel.parallelize_module(module, device_mesh, parallelize_plan)."""
    from spmd.parallel.tp import parallelize_module

    return parallelize_module(module, device_mesh, parallelize_plan)


def _tp_styles() -> list[StrategySpec]:
    from spmd.parallel.tp import ColwiseParallel, RowwiseParallel, SequenceParallel

    return [
        StrategySpec("tp.colwise", ColwiseParallel, "tensor-parallel style: split a Linear's output features"),
        StrategySpec("tp.rowwise", RowwiseParallel, "tensor-parallel style: split a Linear's input features"),
        StrategySpec("tp.sequence", SequenceParallel, "tensor-parallel style: norms/dropout on sequence shards"),
    ]


@hookimpl
def spmd_strategies() -> list[StrategySpec]:
    """The strategies that ship with spmd, and the tensor-parallel styles by name (``tp.<style>``)."""
    return [
        StrategySpec("tp", apply_tp, "tensor parallel: parallelize_module(module, device_mesh=, parallelize_plan=)"),
        *_tp_styles(),
        StrategySpec(
            name="ddp",
            apply=apply_ddp,
            description="data parallel: replicate the module, average gradients in overlapped buckets",
        )
    ]
