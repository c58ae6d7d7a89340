"""The builtin strategies plugin: ``ddp``, ``fsdp``, ``tp`` and the tensor-parallel styles (``tp.<style>``)."""

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


def apply_fsdp(module: nn.Module, **options: Any) -> nn.Module:
    """``fully_shard`` the blocks of ``module``, then ``module`` itself.

    Options: ``mesh``, ``reshard_after_forward``, ``mp_policy`` (as ``fully_shard``), and
    ``units``: the submodules to shard first (default: the items of every ModuleList or
    Sequential child, i.e. a transformer's blocks).
    """
    from spmd.parallel.fsdp import fully_shard

    units = options.pop("units", None)
    if units is None:
        units = []
        for child in module.children():
            if isinstance(child, (nn.ModuleList, nn.Sequential)):
                units.extend(c for c in child.children() if any(True for _ in c.parameters()))
    for unit in units:
        fully_shard(unit, **options)
    return fully_shard(module, **options)


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
        ),
        StrategySpec(
            name="fsdp",
            apply=apply_fsdp,
            description="fully sharded data parallel: shard parameters per module, all-gather for compute, "
            "reduce-scatter gradients",
        ),
    ]


@hookimpl
def spmd_comm_hooks() -> dict[str, Any]:
    """The builtin DDP communication hooks: ``allreduce``, ``fp16_compress`` (``fp16``), ``bf16_compress`` (``bf16``)."""
    from spmd.parallel.comm_hooks import builtin_hooks

    return builtin_hooks()
