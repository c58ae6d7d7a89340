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


@hookimpl
def spmd_strategies() -> list[StrategySpec]:
    """The strategies that ship with spmd."""
    return [
        StrategySpec(
            name="ddp",
            apply=apply_ddp,
            description="data parallel: replicate the module, average gradients in overlapped buckets",
        )
    ]
