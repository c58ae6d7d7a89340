"""``fully_shard``: FSDP applied in place to a module or a group of modules (submodules first, then the root)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from spmd.comm.state import resolve_group
from spmd.errors import SpmdError
from spmd.mesh import DeviceMesh, default_mesh, ensure_world
from spmd.parallel.fsdp.module import fsdp_class
from spmd.parallel.fsdp.policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from spmd.parallel.fsdp.root import UNIT_ATTR, FSDPRoot, unit_of
from spmd.parallel.fsdp.state_dict import adopt_after_load, load_full_tensors_pre_hook
from spmd.parallel.fsdp.unit import FSDPUnit
from spmd.parallel.sync import verify_shapes


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: Any = None,
) -> Any:
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

        with torch.device("meta"):            # optional: no memory until to_empty
            model = Model()
        for block in model.blocks:
            fully_shard(block)
        fully_shard([model.norm, model.head])  # several modules as one unit
        fully_shard(model)
        model.to_empty(device="cpu")           # then initialise: model.reset_parameters() / init_weights()

    ``module``: a module, or a list of modules sharded as one unit (one
    all-gather and one reduce-scatter for all of them; each keeps its hooks).
    ``mesh``: a 1-D mesh shards over all its ranks (default: every rank, on the
    parameters' device type; for meta parameters the accelerator the world has
    a backend for, else the CPU); a 2-D mesh is HSDP: replicate over dim 0,
    shard over dim 1 (reduce-scatter over the shard group, then all-reduce over
    the replicate group). Sharding meta parameters communicates nothing; the
    collectives run on the device ``to_empty``/``.to`` puts them on.
    ``reshard_after_forward``: True (or None, torch's default) frees the
    unsharded parameters after the forward and gathers them again for backward
    (memory); False keeps them until the unit's backward is done (one all-gather
    fewer per step). An int (torch's "reshard to a smaller world") is taken as
    True; the root is never resharded after a forward with grad, since backward starts with it.
    ``mp_policy``: see ``MixedPrecisionPolicy``. ``offload_policy``: ``OffloadPolicy()``
    (none) or ``CPUOffloadPolicy()``, accepted where the parameters are on the CPU
    already (it changes nothing there); spmd does not offload accelerator parameters.
    ``ignored_params``: parameters left as they are (not sharded, not reduced).
    ``shard_placement_fn`` (torch's per-parameter placement) and ``dp_mesh_dims``
    are not supported (NotImplementedError): spmd shards every parameter's dim 0
    over ``mesh``; for 2-D with tensor parallelism pass ``mesh=mesh["dp"]``.

    The module's class becomes ``FSDP<Class>``, a subclass of ``FSDPModule``
    and of its class (as in torch, so ``isinstance(m, FSDPModule)`` holds), with
    ``unshard()``, ``reshard()``, ``set_requires_gradient_sync(bool)``,
    ``set_modules_to_forward_prefetch(modules)``, ``set_gradient_divide_factor(f)``
    and the rest (see ``FSDPModule``). ``module.state_dict()`` holds the sharded
    DTensors; ``spmd.parallel.get_full_state_dict`` gathers plain tensors, and
    ``load_state_dict`` takes either (also with ``assign=True``: the values are
    copied into the unit's flat shard, and the new parameters are its views).
    Every rank must build the same model (no data is broadcast, as in torch).
    ``to_empty``, ``.to(device)`` and ``.half()`` after ``fully_shard`` move the
    unit with its parameters; create the optimizer after them.
    """
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    _check_modules(modules)
    if shard_placement_fn is not None:
        raise NotImplementedError("fully_shard(shard_placement_fn=...): spmd shards every parameter on dim 0; "
                                  "put parameters that need another layout in their own module (or ignored_params)")
    if dp_mesh_dims is not None:
        raise NotImplementedError("fully_shard(dp_mesh_dims=...): pass the data-parallel sub-mesh itself, "
                                  "fully_shard(m, mesh=mesh['dp']) (or a 2-D (replicate, shard) mesh for HSDP)")
    if offload_policy is not None and not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(f"fully_shard: offload_policy must be an OffloadPolicy, got {offload_policy!r}")
    if mesh is None:
        # as torch's (_init_default_mesh): without a world yet, join the job first -- the launcher's
        # environment, or the world torch.distributed.init_process_group made (spmd then reuses its store)
        ensure_world()
        mesh = default_mesh(_device_type(modules))
    if reshard_after_forward is None or isinstance(reshard_after_forward, bool):
        reshard = reshard_after_forward is not False
    elif isinstance(reshard_after_forward, int):
        reshard = True  # torch reshards to a smaller world; spmd reshards fully (the memory saving, not the speed-up)
    else:
        raise TypeError(f"fully_shard: reshard_after_forward must be a bool, an int or None, got {reshard_after_forward!r}")
    named, owners = _managed_parameters(modules, ignored_params or set())
    for group in mesh.get_all_groups():  # ranks that shard other parameters would all-gather garbage
        verify_shapes(named, group, who="fully_shard")
    unit = FSDPUnit(modules, named, owners, mesh, reshard, mp_policy or MixedPrecisionPolicy(),
                    offload_to_cpu=isinstance(offload_policy, CPUOffloadPolicy))
    for m in modules:
        m.__dict__[UNIT_ATTR] = unit
        m.register_forward_pre_hook(_pre_forward, with_kwargs=True)
        m.register_forward_hook(_post_forward)
        m.register_load_state_dict_pre_hook(load_full_tensors_pre_hook(unit))
        m.register_load_state_dict_post_hook(adopt_after_load(unit))
        m.__class__ = fsdp_class(type(m))
    return module


def _check_modules(modules: list[nn.Module]) -> None:
    if not modules:
        raise ValueError("fully_shard: got an empty list of modules")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"fully_shard: expected an nn.Module or a list of them, got {type(m).__name__}")
        if unit_of(m) is not None:
            raise SpmdError(f"fully_shard: {type(m).__name__} is already sharded; apply fully_shard once per module")
    if len({id(m) for m in modules}) != len(modules):
        raise ValueError("fully_shard: the list holds a module twice")


def _device_type(modules: list[nn.Module]) -> str:
    """The default mesh's device type: the parameters' (for meta ones: where they will be materialised)."""
    device = next((p.device.type for m in modules for p in m.parameters()), "cpu")
    if device != "meta":
        return device
    # Meta parameters get memory later (to_empty): as torch, assume the accelerator, where the world can use it.
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    backends = resolve_group(None).backend_map
    if accelerator is not None and (backends is None or accelerator.type in backends):
        return accelerator.type
    return "cpu"


def _managed_parameters(
    modules: list[nn.Module], ignored: set[nn.Parameter]
) -> tuple[list[tuple[str, nn.Parameter]], dict[int, list[tuple[nn.Module, str]]]]:
    """The parameters of ``modules`` outside inner units and ``ignored`` (deduplicated), named relative to their
    module; and every (module, attribute) holding each."""
    skip: set[int] = set()
    for module in modules:
        for name, sub in module.named_modules():
            if name and unit_of(sub) is not None:
                skip.update(id(m) for m in sub.modules())
    inner = {id(p) for module in modules for m in module.modules() if id(m) in skip
             for p in m._parameters.values() if p is not None}
    inner.update(id(p) for p in ignored)
    named: list[tuple[str, nn.Parameter]] = []
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in modules:
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
    return unit.root.pre_forward(unit, module, args, kwargs)


def _post_forward(module: nn.Module, args: Any, output: Any) -> Any:
    unit = unit_of(module)
    assert unit is not None
    return unit.root.post_forward(unit, module, output)


def is_fully_sharded(module: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``module``."""
    return unit_of(module) is not None

