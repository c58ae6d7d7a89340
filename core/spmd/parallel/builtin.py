"""The builtin strategies plugin: ``ddp`` and ``fsdp``."""

from __future__ import annotations

from typing import Any

from torch import nn

from spmd.markers import hookimpl
from spmd.parallel.registry import StrategySpec


def apply_ddp(module: nn.Module, **options: Any) -> nn.Module:
    """Wrap ``module`` in spmd.parallel.DistributedDataParallel(module, **options)."""
    from spmd.parallel.ddp import DistributedDataParallel

    return DistributedDataParallel(module, **options)


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
    """The strategies that ship with spmd."""
    return [
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
