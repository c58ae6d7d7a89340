"""``broadcast_from_rank0``: rank 0's full state dict reaches every rank's shards, one tensor at a time (the other
ranks' state dicts may be empty), for the model and the optimizer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from spmd.checkpoint.assign import assign, global_meta, is_meta, materialised
from spmd.checkpoint.metadata import CheckpointError


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


def set_model_from_rank0(own: Mapping[str, Any], model_state_dict: Mapping[str, Any], strict: bool) -> dict[str, torch.Tensor]:
    """``broadcast_from_rank0``: every tensor of rank 0's full state dict, one at a time, to every rank's shards;
    returns the new tensors for meta targets (to be assigned)."""
    keys = _broadcast_keys(model_state_dict, "set_model_state_dict")
    missing = sorted(set(own) - set(keys))
    unexpected = sorted(set(keys) - set(own))
    if strict and (missing or unexpected):
        raise CheckpointError(f"set_state_dict: rank 0's model state dict lacks {missing[:8]} and has unknown keys {unexpected[:8]}")
    meta: dict[str, torch.Tensor] = {}
    for key in keys:
        target = own.get(key)
        if not isinstance(target, torch.Tensor):
            continue
        shape, dtype, device = global_meta(target)
        full = _broadcast_tensor(model_state_dict.get(key), shape, dtype, device)
        if is_meta(target):
            meta[key] = materialised(target, full, f"model_state_dict[{key!r}]")
        else:
            assign(target, full, f"model_state_dict[{key!r}]")
    return meta


def optimizer_state_from_rank0(optim_state_dict: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
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
