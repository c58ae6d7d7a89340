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

from functools import partial
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from spmd.parallel.fsdp.autograd import PreBackward, UnshardedViews
from spmd.parallel.fsdp.policy import MixedPrecisionPolicy
from spmd.parallel.fsdp.unit import SHARDED, FSDPUnit, PendingReduce

UNIT_ATTR = "_spmd_fsdp_unit"


def unit_of(module: nn.Module) -> FSDPUnit | None:
    """The FSDPUnit of a ``fully_shard``-ed module, else None."""
    return module.__dict__.get(UNIT_ATTR)


class FSDPRoot:
    """Drives every unit under one root module through forward and backward."""

    def __init__(self, root: FSDPUnit) -> None:
        self.root = root
        self.units = list(dict.fromkeys(u for top in root.modules for m in top.modules() if (u := unit_of(m)) is not None))
        for unit in self.units:
            unit.root = self
        self.order: list[FSDPUnit] = []  # forward order, recorded during the first forward
        self._recording = True
        self._pending: list[PendingReduce] = []
        self._callback_queued = False
        self._in_backward: set[FSDPUnit] = set()  # units that ran a forward with grad this iteration

    # -- forward -------------------------------------------------------------------------
    def pre_forward(self, unit: FSDPUnit, module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        """Before ``module``'s forward: unshard its unit and install the unsharded parameters (once per pass of a
        ``fully_shard([a, b])`` group: its later modules find them installed), then cast the inputs."""
        if not unit.pending or len(unit.modules) == 1:  # a single module sets up on every call (a failed pass leaves no trace)
            self._set_up(unit)
            unit.pending = set(unit.modules)
        return _cast_inputs(unit.mp_policy, args, kwargs)

    def _set_up(self, unit: FSDPUnit) -> None:
        grad = torch.is_grad_enabled()
        if self._recording and unit not in self.order:
            self.order.append(unit)
        unit.drop_stale_unsharded()
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

    def post_forward(self, unit: FSDPUnit, module: nn.Module, output: Any) -> Any:
        """After ``module``'s forward: once the unit's last module is done, uninstall (and reshard); hook the
        outputs into backward; cast them to the policy's ``output_dtype``."""
        unit.pending.discard(module)
        if not unit.pending:
            self._tear_down(unit)
        if unit is self.root:
            self._recording = False
            for other in self.units:  # a group module that did not run this pass
                if other.pending:
                    other.pending.clear()
                    self._tear_down(other)
        if torch.is_grad_enabled():
            output = self._hook_backward(unit, output)
        return _cast_outputs(unit.mp_policy, output)

    def _tear_down(self, unit: FSDPUnit) -> None:
        unit.uninstall()
        if not torch.is_grad_enabled() or (unit.reshard_after_forward and unit is not self.root):
            unit.reshard()

    def _hook_backward(self, unit: FSDPUnit, output: Any) -> Any:
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
        if unit is not self.root and unit.reshard_after_backward:
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
                if unit.state != SHARDED and unit.reshard_after_backward:
                    unit.reshard()


def _cast_inputs(policy: MixedPrecisionPolicy, args: Any, kwargs: Any) -> tuple[Any, Any]:
    """The floating-point tensors among the inputs cast to ``param_dtype`` (torch's ``cast_forward_inputs``)."""
    if not policy.cast_forward_inputs or policy.param_dtype is None:
        return args, kwargs
    cast = partial(_cast_float, policy.param_dtype)
    return tree_map(cast, args), tree_map(cast, kwargs)


def _cast_outputs(policy: MixedPrecisionPolicy, output: Any) -> Any:
    return output if policy.output_dtype is None else tree_map(partial(_cast_float, policy.output_dtype), output)


def _cast_float(dtype: torch.dtype, x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
        return x.to(dtype)
    return x
