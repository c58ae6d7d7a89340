"""Writing loaded values into a model's tensors: in place into any placements, or, for tensors still on the meta
device, as new tensors that replace them (a copy into a meta tensor would silently do nothing)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from spmd.checkpoint.metadata import CheckpointError


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


def global_meta(target: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype, torch.device]:
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


def is_meta(target: Any) -> bool:
    from spmd.tensor.dtensor import DTensor

    if isinstance(target, DTensor):
        return target._local_tensor.is_meta
    return isinstance(target, torch.Tensor) and target.is_meta


def materialised(target: torch.Tensor, value: Any, what: str) -> torch.Tensor:
    """``value`` as a new tensor shaped like the meta ``target``: a DTensor with this rank's piece under the
    target's placements, or a plain tensor, on the device ``global_meta`` names."""
    from spmd.tensor.dtensor import DTensor
    from spmd.tensor.spec import holds_zero_summand, local_piece

    shape, dtype, device = global_meta(target)
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


def assign_meta(model: nn.Module, values: Mapping[str, torch.Tensor]) -> None:
    """Meta targets (a model built under ``torch.device("meta")``, not yet ``to_empty``): ``copy_`` into them
    would do nothing, so the new tensors replace them (``load_state_dict(assign=True)``, as torch's
    ``set_model_state_dict`` does; fully_shard's units adopt them)."""
    if values:
        model.load_state_dict(dict(values), strict=False, assign=True)
