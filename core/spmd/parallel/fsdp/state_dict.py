"""State dicts of sharded modules: the full (gathered) form, and loading plain tensors into sharded parameters.

``module.state_dict()`` of a sharded module holds the DTensors themselves
(each rank its rows). ``get_full_state_dict`` gathers every DTensor into a
plain CPU tensor, on rank 0 only or everywhere; ``load_state_dict`` accepts
both forms (a load pre-hook cuts plain tensors down to this rank's rows),
and ``load_full_state_dict(..., broadcast_from_rank0=True)`` needs the full
tensors on rank 0 alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from spmd.comm.collectives import broadcast
from spmd.comm.init import get_rank
from spmd.tensor.dtensor import DTensor
from spmd.tensor.spec import local_piece


def get_full_state_dict(module: nn.Module, *, rank0_only: bool = True, cpu_offload: bool = True) -> dict[str, Any]:
    """``module.state_dict()`` with every DTensor gathered into a plain tensor (a collective: call on every rank).

    With ``rank0_only`` the other ranks get ``{}``; the tensors are gathered one
    at a time, so the peak is one full parameter beyond the shards.
    """
    keep = not rank0_only or get_rank() == 0
    out: dict[str, Any] = {}
    for key, value in module.state_dict().items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if keep:
            value = value.detach()
            out[key] = value.cpu().clone() if cpu_offload else value.clone()
    return out


def load_full_state_dict(
    module: nn.Module, state_dict: Mapping[str, Any], *, broadcast_from_rank0: bool = False, strict: bool = True
) -> Any:
    """Load plain full tensors into a sharded module; with ``broadcast_from_rank0`` only rank 0's ``state_dict`` is read."""
    if broadcast_from_rank0:
        full: dict[str, Any] = {}
        mine = get_rank() == 0
        for key, value in module.state_dict().items():
            shape = tuple(value.shape)
            tensor = state_dict[key].detach().to(value.dtype).clone() if mine else torch.empty(shape, dtype=value.dtype)
            full[key] = _broadcast(tensor.contiguous())
        state_dict = full
    return module.load_state_dict(state_dict, strict=strict)


def _broadcast(tensor: torch.Tensor) -> torch.Tensor:
    broadcast(tensor, src=0)
    return tensor


def load_full_tensors_pre_hook(unit: Any) -> Callable[..., None]:
    """A load_state_dict pre-hook for a module of ``unit``: plain full tensors of the unit's parameters under it
    (under every name, tied ones included) become this rank's DTensor shards."""

    def hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
        index_of = {id(p): i for i, p in enumerate(unit.params)}
        for name, p in module.named_parameters(remove_duplicate=False):
            index = index_of.get(id(p))
            if index is None:
                continue
            key = prefix + name
            value = state_dict.get(key)
            if value is None or isinstance(value, DTensor) or not isinstance(value, torch.Tensor):
                continue
            spec = unit.specs[index]
            if tuple(value.shape) != spec.shape:
                continue  # load_state_dict reports the size mismatch
            state_dict[key] = DTensor(local_piece(value.detach(), spec).to(spec.dtype), spec)

    return hook


def adopt_after_load(unit: Any) -> Callable[..., None]:
    """A load_state_dict post-hook: ``assign=True`` registered new parameters; the unit adopts them (its flat
    shard holds their values, they become its views), so training steps what the forward gathers."""

    def hook(module: nn.Module, incompatible_keys: Any) -> None:
        unit.adopt_parameters(strict=False)  # a partial load may leave some on meta until the next load

    return hook
