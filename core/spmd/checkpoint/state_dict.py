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

from spmd.checkpoint.assign import assign, assign_meta, global_meta, is_meta, materialised
from spmd.checkpoint.metadata import CheckpointError
from spmd.checkpoint.rank0 import optimizer_state_from_rank0, set_model_from_rank0

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


def set_model_state_dict(model: nn.Module, model_state_dict: Mapping[str, Any], *, options: StateDictOptions | None = None) -> None:
    """Copy ``model_state_dict`` into the unwrapped model's parameters and buffers, in place (see StateDictOptions)."""
    options = options or StateDictOptions()
    own = unwrap(model).state_dict(keep_vars=True)
    if options.broadcast_from_rank0:
        assign_meta(unwrap(model), set_model_from_rank0(own, model_state_dict, options.strict))
        return
    missing = sorted(set(own) - set(model_state_dict))
    unexpected = sorted(set(model_state_dict) - set(own))
    if options.strict and (missing or unexpected):
        raise CheckpointError(f"set_state_dict: the model state dict lacks {missing[:8]} and has unknown keys {unexpected[:8]}")
    meta: dict[str, torch.Tensor] = {}
    for key, value in model_state_dict.items():
        if key in own and isinstance(own[key], torch.Tensor):
            if is_meta(own[key]):
                meta[key] = materialised(own[key], value, f"model_state_dict[{key!r}]")
            else:
                assign(own[key], value, f"model_state_dict[{key!r}]")
    assign_meta(unwrap(model), meta)


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
        device = global_meta(first)[2] if first is not None else torch.device("cpu")
        optim_state_dict = optimizer_state_from_rank0(optim_state_dict, device)
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
