"""FSDPRoot: the schedule of one tree of FSDP units (forward order, prefetching, pending reductions).

The outermost ``fully_shard``-ed module becomes the root on its first
forward, as in torch. The root records the order the units run in during
that forward; later forwards prefetch the next unit's all-gather before the
current unit computes, and backward prefetches the previous one (reverse
order), unless ``set_modules_to_forward_prefetch`` / ``..._backward_prefetch``
say otherwise. Reduce-scatters run asynchronously: each unit's reduction is
finished when the next unit's starts (so at most two are in flight), and a
callback queued on the autograd engine finishes the rest and reshards every
unit when backward ends, so ``loss.backward()`` returns with the sharded
gradients set.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from spmd.parallel.fsdp.autograd import PreBackward, UnshardedViews
from spmd.parallel.fsdp.unit import SHARDED, FSDPUnit, PendingReduce

UNIT_ATTR = "_spmd_fsdp_unit"


def unit_of(module: nn.Module) -> FSDPUnit | None:
    """The FSDPUnit of a ``fully_shard``-ed module, else None."""
    return module.__dict__.get(UNIT_ATTR)


class FSDPRoot:
    """Drives every unit under one root module through forward and backward."""

    def __init__(self, root: FSDPUnit) -> None:
        self.root = root
        self.units = [u for m in root.module.modules() if (u := unit_of(m)) is not None]
        for unit in self.units:
            unit.root = self
        self.order: list[FSDPUnit] = []  # forward order, recorded during the first forward
        self._recording = True
        self._pending: list[PendingReduce] = []
        self._callback_queued = False
        self._in_backward: set[FSDPUnit] = set()  # units that ran a forward with grad this iteration

    # -- forward -------------------------------------------------------------------------
    def pre_forward(self, unit: FSDPUnit, args: Any, kwargs: Any) -> tuple[Any, Any]:
        grad = torch.is_grad_enabled()
        if self._recording and unit not in self.order:
            self.order.append(unit)
        unit.unshard()
        unit.wait_unshard()  # before prefetching: its gathered buffer is freed before the next one is allocated
        for target in self._forward_targets(unit):
            target.unshard()
        if grad and unit.grad_params:
            views = list(unit.full_views)
            for index, view in zip(unit.grad_params, UnshardedViews.apply(unit, unit.dummy)):
                views[index] = view
            self._in_backward.add(unit)
        else:
            views = [v.detach() for v in unit.full_views]
        unit.install(views)
        if unit.compute_dtype != unit.dtype:
            cast = lambda t: t.to(unit.compute_dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
            args, kwargs = tree_map(cast, args), tree_map(cast, kwargs)
        return args, kwargs

    def post_forward(self, unit: FSDPUnit, output: Any) -> Any:
        unit.uninstall()
        if unit is self.root:
            self._recording = False
        grad = torch.is_grad_enabled()
        if not grad or (unit.reshard_after_forward and unit is not self.root):
            unit.reshard()
        if not grad:
            return output
        flat, spec = tree_flatten(output)
        positions = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not positions:
            return output
        wrapped = PreBackward.apply(unit, *[flat[i] for i in positions])
        for i, t in zip(positions, wrapped):
            flat[i] = t
        return tree_unflatten(flat, spec)

    def _forward_targets(self, unit: FSDPUnit) -> list[FSDPUnit]:
        if unit.forward_prefetch is not None:
            return unit.forward_prefetch
        if self._recording or unit not in self.order:
            return []
        index = self.order.index(unit)
        return self.order[index + 1 : index + 2]

    # -- backward ------------------------------------------------------------------------
    def _queue_callback(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._finish_backward)

    def pre_backward(self, unit: FSDPUnit) -> None:
        self._queue_callback()
        unit.unshard()
        unit.wait_unshard()
        for target in self._backward_targets(unit):
            if target in self._in_backward:
                target.unshard()

    def _backward_targets(self, unit: FSDPUnit) -> list[FSDPUnit]:
        if unit.backward_prefetch is not None:
            return unit.backward_prefetch
        if unit not in self.order:
            return []
        index = self.order.index(unit)
        return self.order[index - 1 : index] if index > 0 else []

    def post_backward(self, unit: FSDPUnit, grads: tuple[torch.Tensor | None, ...]) -> None:
        self._queue_callback()
        # Memory first: free this unit's unsharded parameters and the previous reduction's buffers
        # (issued one unit ago: usually finished by now) before this reduction allocates its own.
        if unit is not self.root:
            unit.reshard()
        self._finish_pending()
        pending = unit.reduce_gradients(grads)
        if pending is not None:
            self._pending.append(pending)

    def _finish_pending(self) -> None:
        """Finish the reductions in flight; their buffers are freed when this returns (before the next is allocated)."""
        pending, self._pending = self._pending, []
        for earlier in pending:
            earlier.unit.finish_reduce(earlier)

    def _finish_backward(self) -> None:
        try:
            self._finish_pending()
        finally:
            self._pending = []
            self._callback_queued = False
            self._in_backward.clear()
            for unit in self.units:
                if unit.state != SHARDED:
                    unit.reshard()
