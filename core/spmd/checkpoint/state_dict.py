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
from typing import Any

import torch
from torch import nn

from spmd.checkpoint.metadata import CheckpointError

#: Attributes through which wrappers hold the module they wrap.
WRAPPER_ATTRIBUTES = ("module", "_orig_mod")


@dataclass(frozen=True)
class StateDictOptions:
    """``full_state_dict``: DTensors as full tensors; ``cpu_offload``: tensors on CPU; ``strict``: every key must match."""

    full_state_dict: bool = False
    cpu_offload: bool = False
    strict: bool = True


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


def get_model_state_dict(model: nn.Module, *, options: StateDictOptions | None = None) -> dict[str, Any]:
    """The unwrapped model's state dict (DTensors kept unless ``full_state_dict``)."""
    options = options or StateDictOptions()
    return {k: _export(v, options) for k, v in unwrap(model).state_dict().items()}


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
    return {"state": state, "param_groups": groups}


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


def set_model_state_dict(model: nn.Module, model_state_dict: Mapping[str, Any], *, options: StateDictOptions | None = None) -> None:
    """Copy ``model_state_dict`` into the unwrapped model's parameters and buffers, in place."""
    options = options or StateDictOptions()
    own = unwrap(model).state_dict(keep_vars=True)
    missing = sorted(set(own) - set(model_state_dict))
    unexpected = sorted(set(model_state_dict) - set(own))
    if options.strict and (missing or unexpected):
        raise CheckpointError(f"set_state_dict: the model state dict lacks {missing[:8]} and has unknown keys {unexpected[:8]}")
    for key, value in model_state_dict.items():
        if key in own and isinstance(own[key], torch.Tensor):
            assign(own[key], value, f"model_state_dict[{key!r}]")


def set_optimizer_state_dict(
    model: nn.Module, optimizers: Any, optim_state_dict: Mapping[str, Any], *, options: StateDictOptions | None = None
) -> None:
    """Copy a state dict from ``get_optimizer_state_dict`` into the optimizers, in place, resharding tensors."""
    names = _names(unwrap(model))
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
