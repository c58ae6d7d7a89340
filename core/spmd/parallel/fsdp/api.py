"""``fully_shard``: FSDP applied in place to one module (call it on submodules first, then the root)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from spmd.comm.group import ProcessGroup
from spmd.comm.init import get_world_size
from spmd.comm.state import resolve_group
from spmd.errors import SpmdError
from spmd.mesh import DeviceMesh, init_device_mesh
from spmd.parallel.fsdp.policy import MixedPrecisionPolicy
from spmd.parallel.fsdp.root import UNIT_ATTR, FSDPRoot, unit_of
from spmd.parallel.fsdp.state_dict import load_full_tensors_pre_hook
from spmd.parallel.fsdp.unit import FSDPUnit

#: The methods ``fully_shard`` adds to the module it shards (as instance attributes; the class is unchanged).
METHODS = (
    "unshard",
    "reshard",
    "set_requires_gradient_sync",
    "set_modules_to_forward_prefetch",
    "set_modules_to_backward_prefetch",
    "set_reshard_after_forward",
)


def fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int = True,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> nn.Module:
    """Shard ``module``'s parameters over ``mesh`` (FSDP); returns ``module``, changed in place.

    Every parameter of ``module`` that no inner ``fully_shard``-ed module owns
    becomes an ``nn.Parameter`` wrapping a DTensor sharded on dim 0
    (``torch.chunk`` rows; uneven sizes are padded internally). These modules
    are *units*: before a unit's forward and its backward, one all-gather
    brings all of its parameters (the module computes with plain tensors,
    views of one flat buffer); after its backward, one reduce-scatter averages
    the gradients over the data-parallel ranks and leaves them as sharded
    ``.grad``s, so any ``torch.optim`` optimizer steps the shards. The next
    unit's all-gather is issued before the current unit computes (forward and
    backward) and reduce-scatters run asynchronously.

    Apply it to the blocks first, then the root, as in torch::

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)

    ``mesh``: a 1-D mesh shards over all its ranks (default: every rank); a 2-D
    mesh is HSDP: replicate over dim 0, shard over dim 1 (reduce-scatter over
    the shard group, then all-reduce over the replicate group).
    ``reshard_after_forward``: True frees the unsharded parameters after the
    forward and gathers them again for backward (memory); False keeps them
    until the unit's backward is done (one all-gather fewer per step). An int
    (torch's "reshard to a smaller world") is taken as True; the root is never
    resharded after a forward with grad, since backward starts with it.
    ``mp_policy``: see ``MixedPrecisionPolicy``.

    The module gains ``unshard()``, ``reshard()``, ``set_requires_gradient_sync(bool)``,
    ``set_modules_to_forward_prefetch(modules)``, ``set_modules_to_backward_prefetch(modules)``
    and ``set_reshard_after_forward(bool)``. Unlike torch, its class is not swapped:
    these are attributes of the instance. ``module.state_dict()`` holds the sharded
    DTensors; ``spmd.parallel.get_full_state_dict`` gathers plain tensors, and
    ``load_state_dict`` takes either. Every rank must build the same model (no
    data is broadcast, as in torch). Moving the module afterwards (``.to()``,
    ``.half()``) is not supported: the shards are views of one buffer per unit.
    """
    if unit_of(module) is not None:
        raise SpmdError(f"fully_shard: {type(module).__name__} is already sharded; apply fully_shard once per module")
    if mesh is None:
        device = next((p.device.type for p in module.parameters()), "cpu")
        mesh = _default_mesh(device)
    if isinstance(reshard_after_forward, bool):
        reshard = reshard_after_forward
    elif isinstance(reshard_after_forward, int):
        reshard = True  # torch reshards to a smaller world; spmd reshards fully (the memory saving, not the speed-up)
    else:
        raise TypeError(f"fully_shard: reshard_after_forward must be a bool or an int, got {reshard_after_forward!r}")
    named, owners = _managed_parameters(module)
    unit = FSDPUnit(module, named, owners, mesh, reshard, mp_policy or MixedPrecisionPolicy())
    module.__dict__[UNIT_ATTR] = unit
    handle = _Methods(unit)
    for name in METHODS:
        module.__dict__[name] = getattr(handle, name)
    module.register_forward_pre_hook(_pre_forward, with_kwargs=True)
    module.register_forward_hook(_post_forward)
    module.register_load_state_dict_pre_hook(load_full_tensors_pre_hook(unit))
    return module


#: The default 1-D mesh per device type, and the world group it was made in: every unit sharded
#: without mesh= shares its groups (one backend connection set, not one per unit); a new world
#: (after destroy_process_group and init) gets a new mesh.
_default_meshes: dict[str, tuple[ProcessGroup, DeviceMesh]] = {}


def _default_mesh(device: str) -> DeviceMesh:
    world = resolve_group(None)
    cached = _default_meshes.get(device)
    if cached is None or cached[0] is not world:
        cached = _default_meshes[device] = (world, init_device_mesh(device, (get_world_size(),)))
    return cached[1]


def _managed_parameters(module: nn.Module) -> tuple[list[tuple[str, nn.Parameter]], dict[int, list[tuple[nn.Module, str]]]]:
    """The parameters of ``module`` outside inner units (deduplicated), and every (module, attribute) holding each."""
    skip: set[int] = set()
    for name, sub in module.named_modules():
        if name and unit_of(sub) is not None:
            skip.update(id(m) for m in sub.modules())
    named: list[tuple[str, nn.Parameter]] = []
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    inner = {id(p) for m in module.modules() if id(m) in skip for p in m._parameters.values() if p is not None}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        if id(sub) in skip:
            continue
        for attr, p in sub._parameters.items():
            if p is None or id(p) in inner:
                continue
            if id(p) not in owners:
                owners[id(p)] = []
                named.append((f"{prefix}.{attr}" if prefix else attr, p))
            if (sub, attr) not in owners[id(p)]:
                owners[id(p)].append((sub, attr))
    return named, owners


def _pre_forward(module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
    unit = unit_of(module)
    assert unit is not None
    if unit.root is None:
        FSDPRoot(unit)  # the outermost unit to run a forward becomes the root of its subtree
    return unit.root.pre_forward(unit, args, kwargs)


def _post_forward(module: nn.Module, args: Any, output: Any) -> Any:
    unit = unit_of(module)
    assert unit is not None
    return unit.root.post_forward(unit, output)


class UnshardHandle:
    """What ``unshard(async_op=True)`` returns: ``wait()`` finishes the all-gather."""

    def __init__(self, unit: FSDPUnit) -> None:
        self._unit = unit

    def wait(self) -> None:
        self._unit.wait_unshard()


class _Methods:
    """The methods a sharded module gains (bound to its unit)."""

    def __init__(self, unit: FSDPUnit) -> None:
        self._unit = unit

    def _units(self) -> list[FSDPUnit]:
        return [u for m in self._unit.module.modules() if (u := unit_of(m)) is not None]

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters now (the next forward uses them); async: returns a handle."""
        self._unit.unshard()
        handle = UnshardHandle(self._unit)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free this module's unsharded parameters."""
        self._unit.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: backward only accumulates unsharded gradients locally; the next backward with True reduces them all.

        For gradient accumulation: the accumulated unsharded gradients cost one
        unsharded copy of the parameters (in their dtype) until the syncing backward.
        """
        for unit in self._units() if recurse else [self._unit]:
            unit.requires_gradient_sync = requires_gradient_sync

    def set_modules_to_forward_prefetch(self, modules: Iterable[nn.Module]) -> None:
        """All-gather these sharded modules' parameters (async) before this module's forward computes."""
        self._unit.forward_prefetch = _units_of(modules, "set_modules_to_forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules: Iterable[nn.Module]) -> None:
        """All-gather these sharded modules' parameters (async) before this module's backward computes."""
        self._unit.backward_prefetch = _units_of(modules, "set_modules_to_backward_prefetch")

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        for unit in self._units() if recurse else [self._unit]:
            unit.reshard_after_forward = bool(reshard_after_forward)


def _units_of(modules: Iterable[nn.Module], what: str) -> list[FSDPUnit]:
    units = []
    for m in modules:
        unit = unit_of(m)
        if unit is None:
            raise SpmdError(f"{what}: {type(m).__name__} is not fully_shard-ed; pass modules fully_shard was applied to")
        units.append(unit)
    return units


def is_fully_sharded(module: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``module``."""
    return unit_of(module) is not None

