"""The two autograd Functions that hook FSDP into backward.

``UnshardedViews`` hands the module its unsharded parameters (views of the
unit's flat buffer) in forward; its backward runs once, when the gradients of
all of them are in, and starts the unit's reduce-scatter. ``PreBackward`` is an
identity on the unit's outputs; its backward runs before any of the unit's
backward computation and unshards the unit (and prefetches the next one).
"""

from __future__ import annotations

from typing import Any

import torch


class UnshardedViews(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, unit: Any, dummy: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.unit = unit
        ctx.set_materialize_grads(False)
        return tuple(unit.full_views[i].view(unit.full_views[i].shape) for i in unit.grad_params)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        ctx.unit.root.post_backward(ctx.unit, grads)
        return None, None


class PreBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, unit: Any, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.unit = unit
        ctx.set_materialize_grads(False)
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        ctx.unit.root.pre_backward(ctx.unit)
        return (None, *grads)
