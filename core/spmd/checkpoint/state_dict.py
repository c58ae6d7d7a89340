"""``get_state_dict``/``set_state_dict``: model and optimizer state keyed by parameter names, free of wrappers.

Keys are the names in the unwrapped model (no ``module.`` from DDP, no
``_orig_mod.`` from torch.compile), so a checkpoint saved from a DDP job loads
into a tensor-parallel or FSDP one. Parameters that are DTensors (tensor
parallel, ``fully_shard``) stay DTensors: the state dict is sharded, and
``save`` writes each rank's shards. ``full_state_dict=True`` gathers them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Union

import torch
from torch import nn

from spmd.checkpoint.metadata import CheckpointError

#: Attributes through which wrappers hold the module they wrap.
WRAPPER_ATTRIBUTES = ("module", "_orig_mod")


#: torch's type names for state dict values (``torch.distributed.checkpoint.state_dict``).
FQNS_T = set[str]
PrimitiveType = torch.Tensor | int | float | str  # (torch's lists DTensor too: a torch.Tensor subclass)
ValueType = Union[PrimitiveType, list[PrimitiveType], tuple[PrimitiveType], dict[str, "ValueType"]]  # noqa: UP007 - recursive: needs the string
DictValueType = dict[str, ValueType]
ListDictValueType = list[DictValueType]
OptimizerStateType = dict[str, DictValueType | ListDictValueType]


@dataclass(frozen=True)
class StateDictOptions:
    """How ``get_*``/``set_*`` work; torch's fields, in torch's order.

    ``full_state_dict``: DTensors gathered into full tensors. ``cpu_offload``:
    tensors on CPU; with ``full_state_dict``, only rank 0 gets the state dict
    (the others get ``{}``), as torch does, so N ranks do not hold N full copies.
    ``ignore_frozen_params``: parameters with ``requires_grad=False`` left out.
    ``keep_submodule_prefixes``: accepted for torch's signature (it only
    matters for torch's deprecated ``submodules=``, which spmd does not take).
    ``strict``: ``set_*`` requires every key to match. ``broadcast_from_rank0``
    (needs ``full_state_dict``): ``set_*`` takes rank 0's full state dict (the
    other ranks may pass ``{}``), broadcasts it tensor by tensor and each rank
    keeps its shards. ``flatten_optimizer_state_dict``: the optimizer state dict
    as flat ``state.<fqn>.<key>``/``param_groups.<fqn>.<key>`` keys (``set_*``
    takes it back). ``dsd_fqn_modifiers``: accepted, unused (spmd unwraps
    DDP/torch.compile by their attributes).
    """

    full_state_dict: bool = False
    cpu_offload: bool = False
    ignore_frozen_params: bool = False
    keep_submodule_prefixes: bool = True
    strict: bool = True
    broadcast_from_rank0: bool = False
    flatten_optimizer_state_dict: bool = False
    dsd_fqn_modifiers: str = "_fqn_modifiers"

    def __post_init__(self) -> None:
        if self.broadcast_from_rank0 and not self.full_state_dict:
            raise ValueError("StateDictOptions: broadcast_from_rank0=True needs full_state_dict=True (as in torch)")


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside DDP-style wrappers (``.module``) and torch.compile (``._orig_mod``)."""
    while True:
        inner = next((getattr(model, a) for a in WRAPPER_ATTRIBUTES if isinstance(getattr(model, a, None), nn.Module)), None)
        if inner is None or set(dict(model.named_children())) - {"module", "_orig_mod"}:
            return model
        model = inner


def _optimizers(optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None) -> list[torch.optim.Optimizer]:
    if optimizers is None:
        return []
    return [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)


def _export(value: Any, options: StateDictOptions) -> Any:
    from spmd.tensor.dtensor import DTensor

    if isinstance(value, torch.Tensor):
        value = value.detach()
        if options.full_state_dict and isinstance(value, DTensor):
            value = value.full_tensor()
        if options.cpu_offload and value.device.type != "cpu":
            value = value.cpu()
    return value


def _names(model: nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name)
    return names


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state as torch does: one step with zero gradients and a learning rate of 0."""
    if optimizer.state:
        return
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if any(p.grad is not None for p in params):
        return  # gradients pending: a step would apply them; the state appears at the caller's next step
    for p in params:
        p.grad = torch.zeros_like(p)
    rates = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
    try:
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, rates):
            g["lr"] = lr
        optimizer.zero_grad(set_to_none=True)


#: torch's private name for it (``torch.distributed.checkpoint.state_dict._init_optim_state``), which
#: pytorch/examples' FSDP2 checkpoint.py imports to fill a sharded optimizer state by hand.
_init_optim_state = init_optimizer_state


def _rank0_only(options: StateDictOptions) -> bool:
    """torch's rule: a full state dict offloaded to CPU is kept on rank 0 only (gathered on every rank first)."""
    from spmd.comm.init import get_rank
    from spmd.comm.state import is_initialized

    return options.full_state_dict and options.cpu_offload and is_initialized() and get_rank() != 0


def get_model_state_dict(model: nn.Module, *, options: StateDictOptions | None = None) -> dict[str, Any]:
    """The unwrapped model's state dict (DTensors kept unless ``full_state_dict``; see StateDictOptions)."""
    options = options or StateDictOptions()
    inner = unwrap(model)
    frozen = {n for n, p in inner.named_parameters(remove_duplicate=False) if not p.requires_grad} if options.ignore_frozen_params else set()
    out = {k: _export(v, options) for k, v in inner.state_dict().items() if k not in frozen}
    return {} if _rank0_only(options) else out


def get_optimizer_state_dict(
    model: nn.Module, optimizers: Any, *, options: StateDictOptions | None = None
) -> dict[str, Any]:
    """``{"state": {param name: {...}}, "param_groups": [{..., "params": [param names]}]}`` over all optimizers."""
    options = options or StateDictOptions()
    names = _names(unwrap(model))
    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    for optimizer in _optimizers(optimizers):
        init_optimizer_state(optimizer)
        for group in optimizer.param_groups:
            fqns = []
            for p in group["params"]:
                if id(p) not in names:
                    raise CheckpointError("an optimizer holds a parameter that the model does not; pass the model it optimizes")
                fqn = names[id(p)]
                fqns.append(fqn)
                if p in optimizer.state:
                    state[fqn] = {k: _export(v, options) for k, v in optimizer.state[p].items()}
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": fqns})
    if _rank0_only(options):
        return {}
    out: dict[str, Any] = {"state": state, "param_groups": groups}
    return flatten_optimizer_state_dict(out) if options.flatten_optimizer_state_dict else out


def flatten_optimizer_state_dict(optim_state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """torch's flat optimizer layout: ``state.<fqn>.<key>`` (nested dicts dotted) and ``param_groups.<fqn>.<key>``."""
    out: dict[str, Any] = {}

    def nested(prefix: str, value: Mapping[str, Any]) -> None:
        for k, v in value.items():
            if isinstance(v, Mapping):
                nested(f"{prefix}.{k}", v)
            else:
                out[f"{prefix}.{k}"] = v

    for fqn, state in optim_state_dict["state"].items():
        nested(f"state.{fqn}", state)
    for group in optim_state_dict["param_groups"]:
        for fqn in group["params"]:
            for k, v in group.items():
                if k != "params":
                    out[f"param_groups.{fqn}.{k}"] = v
    return out


def unflatten_optimizer_state_dict(flat: Mapping[str, Any], fqns: Iterable[str]) -> dict[str, Any]:
    """The nested layout back from ``flatten_optimizer_state_dict``'s, given the model's parameter names."""
    by_length = sorted(fqns, key=len, reverse=True)  # "a.b.weight" before "a.b": the longest name that matches
    state: dict[str, Any] = {}
    groups: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        section, _, rest = key.partition(".")
        fqn = next((f for f in by_length if rest.startswith(f + ".")), None)
        if section not in ("state", "param_groups") or fqn is None:
            raise CheckpointError(f"set_optimizer_state_dict: flattened key {key!r} names no parameter of the model")
        path = rest[len(fqn) + 1 :]
        if section == "param_groups":
            groups.setdefault(fqn, {})[path] = value
            continue
        target = state.setdefault(fqn, {})
        *parents, leaf = path.split(".")
        for part in parents:
            target = target.setdefault(part, {})
        target[leaf] = value
    return {"state": state, "param_groups": [{**g, "params": [fqn]} for fqn, g in groups.items()]}


def get_state_dict(
    model: nn.Module, optimizers: Any = None, *, options: StateDictOptions | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(model_state_dict, optimizer_state_dict)`` keyed by parameter names, optimizer state initialised.

    As torch's ``get_state_dict``: an optimizer that has not stepped yet gets
    its state by one step with zero gradients and learning rate 0, so the
    state dict has every tensor that ``load`` must fill.

        model_sd, optim_sd = spmd.checkpoint.get_state_dict(model, optimizer)
        spmd.checkpoint.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    """
    return get_model_state_dict(model, options=options), get_optimizer_state_dict(model, optimizers, options=options)


def assign(target: torch.Tensor, value: Any, what: str = "value") -> None:
    """Copy ``value`` into ``target`` in place, whatever each one's placements (a full tensor into a shard too).

    The global shapes must be equal (as torch's ``load_state_dict`` requires):
    a copy would broadcast a smaller value, and slicing a shard out of a
    larger one would truncate it, both without an error.
    """
    from spmd.tensor.dtensor import DTensor
    from spmd.tensor.spec import holds_zero_summand, local_piece

    shape = tuple(target._spec.shape) if isinstance(target, DTensor) else tuple(target.shape)
    given = tuple(value.shape) if isinstance(value, torch.Tensor) else tuple(torch.as_tensor(value).shape)
    if given != shape:
        raise CheckpointError(f"{what} has shape {list(given)} but the tensor it should fill has shape {list(shape)}; "
                              "load a state dict of the same model (resharding changes placements, not shapes)")
    with torch.no_grad():
        if isinstance(target, DTensor):
            spec = target._spec
            if isinstance(value, DTensor):
                if value._spec.placements != spec.placements or value._spec.mesh != spec.mesh:
                    value = value.redistribute(spec.mesh, spec.placements) if value._spec.mesh == spec.mesh else value.full_tensor()
                if isinstance(value, DTensor):
                    target._local_tensor.copy_(value._local_tensor)
                    return
            value = torch.as_tensor(value)
            coordinate = spec.mesh.get_coordinate()
            if coordinate is None:  # not in the mesh: no piece to fill
                return
            if holds_zero_summand(spec, coordinate):
                target._local_tensor.zero_()
            else:
                target._local_tensor.copy_(local_piece(value, spec) if value.ndim else value)
        else:
            target.copy_(value.full_tensor() if isinstance(value, DTensor) else value)


def _broadcast_keys(state_dict: Mapping[str, Any], what: str) -> list[str]:
    """Rank 0's keys, on every rank (``broadcast_from_rank0``: the other ranks' state dicts may be empty)."""
    from spmd.comm.init import get_rank
    from spmd.comm.objects import broadcast_object_list

    keys: list[Any] = [sorted(state_dict) if get_rank() == 0 else None]
    broadcast_object_list(keys, src=0)
    if not keys[0] and get_rank() == 0:
        raise CheckpointError(f"{what}: broadcast_from_rank0=True but rank 0's state dict is empty")
    return keys[0]


def _broadcast_tensor(value: Any, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Rank 0's full ``value`` on every rank (the others allocate ``shape``/``dtype`` on ``device`` to receive it)."""
    from spmd.comm.collectives import broadcast
    from spmd.comm.init import get_rank
    from spmd.tensor.dtensor import DTensor

    if get_rank() == 0:
        if isinstance(value, DTensor) or value is None:  # (a DTensor's full_tensor() here would wait for the other ranks)
            raise CheckpointError(
                "broadcast_from_rank0: rank 0 must hold a full state dict of plain tensors (get it with "
                f"StateDictOptions(full_state_dict=True)); it has {'no value' if value is None else 'a DTensor'} "
                f"for a tensor of shape {list(shape)}"
            )
        full = torch.as_tensor(value).detach().to(device=device, dtype=dtype).contiguous()
        if tuple(full.shape) != shape:
            raise CheckpointError(f"broadcast_from_rank0: rank 0's value has shape {list(full.shape)}, the model's {list(shape)}")
    else:
        full = torch.empty(shape, dtype=dtype, device=device)
    broadcast(full, src=0)
    return full


def _global_meta(target: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype, torch.device]:
    """The global shape, dtype and the device the target's values live on (for a meta target, where
    ``to_empty`` would put them: the mesh's device type, else the world's default device, as torch's)."""
    from spmd.tensor.dtensor import DTensor

    device = target._local_tensor.device if isinstance(target, DTensor) else target.device
    if device.type == "meta":
        device = torch.device(target._spec.mesh.device_type) if isinstance(target, DTensor) else _default_device()
    return tuple(target.shape), target.dtype, device


def _default_device() -> torch.device:
    """The device torch's ``_get_pg_default_device`` would name: the accelerator if the world has a backend
    for it, else the CPU."""
    from spmd.comm.state import is_initialized, resolve_group

    accelerator = torch.accelerator.current_accelerator(check_available=True)
    if accelerator is not None and is_initialized():
        backends = resolve_group(None).backend_map
        if backends is None or accelerator.type in backends:
            return torch.device(accelerator.type)
    return torch.device("cpu")


def _is_meta(target: Any) -> bool:
    from spmd.tensor.dtensor import DTensor

    if isinstance(target, DTensor):
        return target._local_tensor.is_meta
    return isinstance(target, torch.Tensor) and target.is_meta


def _materialised(target: torch.Tensor, value: Any, what: str) -> torch.Tensor:
    """``value`` as a new tensor shaped like the meta ``target``: a DTensor with this rank's piece under the
    target's placements, or a plain tensor, on the device ``_global_meta`` names."""
    from spmd.tensor.dtensor import DTensor
    from spmd.tensor.spec import holds_zero_summand, local_piece

    shape, dtype, device = _global_meta(target)
    if isinstance(value, DTensor):
        value = value.full_tensor()
    value = torch.as_tensor(value).detach()
    if tuple(value.shape) != shape:
        raise CheckpointError(f"{what} has shape {list(value.shape)} but the tensor it should fill has shape {list(shape)}; "
                              "load a state dict of the same model (resharding changes placements, not shapes)")
    value = value.to(device=device, dtype=dtype)
    if not isinstance(target, DTensor):
        return value.clone()
    spec = target._spec
    coordinate = spec.mesh.get_coordinate()
    piece = local_piece(value, spec) if value.ndim else value
    if coordinate is not None and holds_zero_summand(spec, coordinate):
        piece = torch.zeros_like(piece)
    return DTensor(piece.clone().contiguous(), spec)


def _assign_meta(model: nn.Module, values: Mapping[str, torch.Tensor]) -> None:
    """Meta targets (a model built under ``torch.device("meta")``, not yet ``to_empty``): ``copy_`` into them
    would do nothing, so the new tensors replace them (``load_state_dict(assign=True)``, as torch's
    ``set_model_state_dict`` does; fully_shard's units adopt them)."""
    if values:
        model.load_state_dict(dict(values), strict=False, assign=True)


def _set_model_from_rank0(
    own: Mapping[str, Any], model_state_dict: Mapping[str, Any], options: StateDictOptions
) -> dict[str, torch.Tensor]:
    """``broadcast_from_rank0``: every tensor of rank 0's full state dict, one at a time, to every rank's shards;
    returns the new tensors for meta targets (to be assigned)."""
    keys = _broadcast_keys(model_state_dict, "set_model_state_dict")
    missing = sorted(set(own) - set(keys))
    unexpected = sorted(set(keys) - set(own))
    if options.strict and (missing or unexpected):
        raise CheckpointError(f"set_state_dict: rank 0's model state dict lacks {missing[:8]} and has unknown keys {unexpected[:8]}")
    meta: dict[str, torch.Tensor] = {}
    for key in keys:
        target = own.get(key)
        if not isinstance(target, torch.Tensor):
            continue
        shape, dtype, device = _global_meta(target)
        full = _broadcast_tensor(model_state_dict.get(key), shape, dtype, device)
        if _is_meta(target):
            meta[key] = _materialised(target, full, f"model_state_dict[{key!r}]")
        else:
            assign(target, full, f"model_state_dict[{key!r}]")
    return meta


def _optimizer_state_from_rank0(optim_state_dict: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    """Rank 0's optimizer state dict on every rank: its structure as one object, then its tensors one by one."""
    from spmd.comm.init import get_rank
    from spmd.comm.objects import broadcast_object_list

    tensors: list[torch.Tensor] = []

    def skeleton(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            tensors.append(value)
            return ("__tensor__", tuple(value.shape), value.dtype)
        if isinstance(value, Mapping):
            return {k: skeleton(v) for k, v in value.items()}
        if isinstance(value, list):
            return [skeleton(v) for v in value]
        return value

    box: list[Any] = [skeleton(dict(optim_state_dict)) if get_rank() == 0 else None]
    broadcast_object_list(box, src=0)
    queue = iter(tensors)

    def fill(value: Any) -> Any:
        if isinstance(value, tuple) and len(value) == 3 and value[0] == "__tensor__":
            return _broadcast_tensor(next(queue, None), value[1], value[2], device)
        if isinstance(value, dict):
            return {k: fill(v) for k, v in value.items()}
        if isinstance(value, list):
            return [fill(v) for v in value]
        return value

    return fill(box[0])


def set_model_state_dict(model: nn.Module, model_state_dict: Mapping[str, Any], *, options: StateDictOptions | None = None) -> None:
    """Copy ``model_state_dict`` into the unwrapped model's parameters and buffers, in place (see StateDictOptions)."""
    options = options or StateDictOptions()
    own = unwrap(model).state_dict(keep_vars=True)
    if options.broadcast_from_rank0:
        _assign_meta(unwrap(model), _set_model_from_rank0(own, model_state_dict, options))
        return
    missing = sorted(set(own) - set(model_state_dict))
    unexpected = sorted(set(model_state_dict) - set(own))
    if options.strict and (missing or unexpected):
        raise CheckpointError(f"set_state_dict: the model state dict lacks {missing[:8]} and has unknown keys {unexpected[:8]}")
    meta: dict[str, torch.Tensor] = {}
    for key, value in model_state_dict.items():
        if key in own and isinstance(own[key], torch.Tensor):
            if _is_meta(own[key]):
                meta[key] = _materialised(own[key], value, f"model_state_dict[{key!r}]")
            else:
                assign(own[key], value, f"model_state_dict[{key!r}]")
    _assign_meta(unwrap(model), meta)


def set_optimizer_state_dict(
    model: nn.Module, optimizers: Any, optim_state_dict: Mapping[str, Any], *, options: StateDictOptions | None = None
) -> None:
    """Copy a state dict from ``get_optimizer_state_dict`` into the optimizers, in place, resharding tensors.

    With ``broadcast_from_rank0``, rank 0's full state dict reaches every rank
    (its tensors one by one) before each rank keeps its shards; with
    ``flatten_optimizer_state_dict``, the flat layout is accepted.
    """
    options = options or StateDictOptions()
    names = _names(unwrap(model))
    if options.broadcast_from_rank0:
        first = next((p for opt in _optimizers(optimizers) for g in opt.param_groups for p in g["params"]), None)
        device = _global_meta(first)[2] if first is not None else torch.device("cpu")
        optim_state_dict = _optimizer_state_from_rank0(optim_state_dict, device)
    if "state" not in optim_state_dict and "param_groups" not in optim_state_dict and optim_state_dict:
        optim_state_dict = unflatten_optimizer_state_dict(optim_state_dict, names.values())
    saved_groups = {fqn: g for g in optim_state_dict.get("param_groups", []) for fqn in g["params"]}
    saved_state = optim_state_dict.get("state", {})
    for optimizer in _optimizers(optimizers):
        init_optimizer_state(optimizer)
        for group in optimizer.param_groups:
            for p in group["params"]:
                fqn = names[id(p)]
                for k, v in (saved_groups.get(fqn) or {}).items():
                    if k != "params":
                        group[k] = v
                state = optimizer.state[p]
                for k, v in saved_state.get(fqn, {}).items():
                    if isinstance(state.get(k), torch.Tensor) and isinstance(v, torch.Tensor):
                        assign(state[k], v, f"optimizer state {k!r} of {fqn!r}")
                    else:
                        state[k] = v


def set_state_dict(
    model: nn.Module,
    optimizers: Any = None,
    *,
    model_state_dict: Mapping[str, Any] | None = None,
    optim_state_dict: Mapping[str, Any] | None = None,
    options: StateDictOptions | None = None,
) -> None:
    """Load what ``get_state_dict`` gave (sharded or full) into the model and optimizers, in place."""
    if model_state_dict is not None:
        set_model_state_dict(model, model_state_dict, options=options)
    if optim_state_dict is not None:
        set_optimizer_state_dict(model, optimizers, optim_state_dict, options=options)
