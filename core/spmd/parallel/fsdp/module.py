"""FSDPModule: the class a ``fully_shard``-ed module becomes, so ``isinstance(m, FSDPModule)`` holds (as in torch).

``fully_shard`` swaps the module's class to ``FSDP<Orig>``, a subclass of
``FSDPModule`` and of its own class, made once per class. Its methods
(``unshard``, ``set_requires_gradient_sync``, ...) act on the module's
``FSDPUnit``; ``_apply`` (``to_empty``, ``.to``, ``.half``) re-points the unit's
flat shard at the parameters it leaves on the module, so the forward gathers
what the optimizer steps. A swapped module refuses ``copy.deepcopy`` and pickling
(its unit holds process groups and one flat buffer shared by its shards):
save a state dict instead, as in torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NoReturn

from torch import nn

from spmd.errors import SpmdError
from spmd.parallel.fsdp.root import unit_of
from spmd.parallel.fsdp.unit import FSDPUnit

#: The original class -> its FSDP subclass (one per class, so every sharded Linear has the same class).
_classes: dict[type, type] = {}


def fsdp_class(cls: type) -> type:
    """``FSDP<cls>``: a subclass of ``FSDPModule`` and ``cls`` (FSDPModule first, so its methods win)."""
    if issubclass(cls, FSDPModule):
        return cls
    sub = _classes.get(cls)
    if sub is None:
        sub = _classes[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return sub


class UnshardHandle:
    """What ``unshard(async_op=True)`` returns: ``wait()`` finishes the all-gather."""

    def __init__(self, unit: FSDPUnit) -> None:
        self._unit = unit

    def wait(self) -> None:
        self._unit.wait_unshard()


def _unit(module: Any) -> FSDPUnit:
    unit = unit_of(module)
    if unit is None:
        raise SpmdError(f"{type(module).__name__} has the FSDP class but no FSDP unit (it was not made by fully_shard)")
    return unit


def _units_below(module: nn.Module, recurse: bool) -> list[FSDPUnit]:
    """The units of ``module`` and (``recurse``) every module below it, each once."""
    found = [unit_of(m) for m in module.modules()] if recurse else [unit_of(module)]
    return list(dict.fromkeys(u for u in found if u is not None))


def _units_of(modules: Iterable[nn.Module], what: str) -> list[FSDPUnit]:
    units = []
    for m in modules:
        unit = unit_of(m)
        if unit is None:
            raise SpmdError(f"{what}: {type(m).__name__} is not fully_shard-ed; pass modules fully_shard was applied to")
        units.append(unit)
    return units


def _unsupported(name: str, hint: str) -> Callable[..., NoReturn]:
    def method(self: Any, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(f"FSDPModule.{name} is torch's; spmd does not implement it: {hint}")

    method.__name__ = name
    method.__doc__ = f"Not implemented in spmd: {hint}"
    return method


class FSDPModule:
    """The methods of a ``fully_shard``-ed module (mixed into its class by ``fully_shard``)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """Constructing an ``FSDP<Orig>`` (a container re-creating its class when sliced) builds a plain ``Orig``."""
        orig = next(c for c in cls.__mro__[1:] if c is not FSDPModule and not issubclass(c, FSDPModule))
        self = orig.__new__(orig, *args, **kwargs)
        orig.__init__(self, *args, **kwargs)
        return self

    def __deepcopy__(self, memo: Any) -> NoReturn:
        raise SpmdError("a fully_shard-ed module cannot be deep-copied (its unit holds process groups and a shared flat "
                        "shard); copy the model before fully_shard, or save get_full_state_dict(model) and load it")

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        raise SpmdError("a fully_shard-ed module cannot be pickled; save model.state_dict() (spmd.checkpoint) or "
                        "get_full_state_dict(model) instead")

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``nn.Module._apply`` (to_empty, .to, .half ...), then the unit adopts the parameters it left on the module."""
        unit = _unit(self)
        unit.reshard()
        out = super()._apply(fn, *args, **kwargs)  # type: ignore[misc]
        unit.adopt_parameters(strict=False)  # a group's other modules may not have been applied yet
        return out

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters now (the next forward uses them); async: returns a handle."""
        unit = _unit(self)
        unit.unshard()
        handle = UnshardHandle(unit)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free this module's unsharded parameters (not recursive, as in torch)."""
        _unit(self).reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: backward only accumulates unsharded gradients locally; the next backward with True reduces them all.

        For gradient accumulation: the accumulated unsharded gradients cost one
        unsharded copy of the parameters (in their dtype) until the syncing backward.
        """
        for unit in _units_below(self, recurse):  # type: ignore[arg-type]
            unit.requires_gradient_sync = requires_gradient_sync
            unit.requires_all_reduce = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: False reduce-scatters but skips the all-reduce over the replicate dimension; the reduce-scattered
        gradients accumulate (not set as ``.grad``) until a backward with True all-reduces them all."""
        for unit in _units_below(self, recurse):  # type: ignore[arg-type]
            unit.requires_all_reduce = requires_all_reduce

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether the unsharded parameters are freed after forward (and gathered again for backward)."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}")
        for unit in _units_below(self, recurse):  # type: ignore[arg-type]
            unit.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """False keeps the unsharded parameters after backward (no all-gather in the next forward): for the
        micro-batches of gradient accumulation. An optimizer step in between is seen (the parameters' version
        counters moved) and the next forward gathers again, so it never computes with stale parameters."""
        for unit in _units_below(self, recurse):  # type: ignore[arg-type]
            unit.reshard_after_backward = reshard_after_backward

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for torch scripts; spmd finishes every backward's reductions when that backward ends, so
        there is nothing to defer and the flag changes nothing."""
        _unit(self).is_last_backward = is_last_backward

    def set_modules_to_forward_prefetch(self, modules: Iterable[nn.Module]) -> None:
        """All-gather these sharded modules' parameters (async) before this module's forward computes."""
        _unit(self).forward_prefetch = _units_of(modules, "set_modules_to_forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules: Iterable[nn.Module]) -> None:
        """All-gather these sharded modules' parameters (async) before this module's backward computes."""
        _unit(self).backward_prefetch = _units_of(modules, "set_modules_to_backward_prefetch")

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Gradients are summed over the data-parallel ranks and divided by ``factor`` (default: their number)."""
        if factor <= 0:
            raise ValueError(f"set_gradient_divide_factor: factor must be positive, got {factor}")
        _unit(self).gradient_divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Torch's older name of ``set_gradient_divide_factor``."""
        self.set_gradient_divide_factor(factor)

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """spmd always reduces unused parameters' gradients (as zeros), so every rank issues the same collectives."""
        if not reduce_scatter_unused_params:
            raise NotImplementedError("spmd always reduce-scatters unused parameters' gradients as zeros; it cannot skip them")

    set_post_optim_event = _unsupported(
        "set_post_optim_event", "spmd issues all-gathers in program order after the optimizer step, with no side "
        "stream to wait on; drop the call")
    set_custom_all_gather = _unsupported(
        "set_custom_all_gather", "choose the collective's backend with spmd.init(backend=...) or init_device_mesh(backend=...)")
    set_custom_reduce_scatter = _unsupported(
        "set_custom_reduce_scatter", "choose the collective's backend with spmd.init(backend=...) or init_device_mesh(backend=...)")
    set_all_reduce_hook = _unsupported(
        "set_all_reduce_hook", "use set_requires_all_reduce(False) and reduce the sharded .grad yourself")
    set_force_sum_reduction_for_comms = _unsupported(
        "set_force_sum_reduction_for_comms", "spmd already reduces with SUM after dividing by the factor")
    set_unshard_in_backward = _unsupported(
        "set_unshard_in_backward", "put the parameters backward does not need in their own fully_shard unit")
    set_reduce_scatter_max_input_buffers = _unsupported(
        "set_reduce_scatter_max_input_buffers", "spmd keeps at most two reductions in flight")
    set_separate_reduce_scatter_group = _unsupported(
        "set_separate_reduce_scatter_group", "pass fully_shard a mesh built with the backend you want")
    set_allocate_memory_from_process_group_for_comm = _unsupported(
        "set_allocate_memory_from_process_group_for_comm", "spmd allocates its buffers with torch")
    set_symm_mem_for_comm = _unsupported("set_symm_mem_for_comm", "spmd allocates its buffers with torch")
    reset_iter_state = _unsupported(
        "reset_iter_state", "after an exception mid-step, call reshard() on every fully_shard-ed module and zero the grads")
