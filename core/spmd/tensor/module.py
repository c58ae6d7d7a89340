"""``distribute_module``: torch's generic way to make a module's parameters DTensors, with input/output hooks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from spmd.mesh import DeviceMesh, default_mesh
from spmd.tensor.dtensor import DTensor, distribute_tensor
from spmd.tensor.placements import Replicate


def _replicate_rest(module: nn.Module, mesh: DeviceMesh) -> None:
    """Every parameter and buffer of ``module`` itself that ``partition_fn`` left plain becomes a replicated DTensor."""
    replicate = [Replicate()] * mesh.ndim
    for name, param in list(module._parameters.items()):
        if param is not None and not isinstance(param, DTensor):
            module.register_parameter(name, nn.Parameter(distribute_tensor(param.data, mesh, replicate), param.requires_grad))
    for name, buffer in list(module._buffers.items()):
        if buffer is not None and not isinstance(buffer, DTensor):
            module._buffers[name] = distribute_tensor(buffer, mesh, replicate)


def distribute_module(
    module: nn.Module,
    device_mesh: DeviceMesh | None = None,
    partition_fn: Callable[[str, nn.Module, DeviceMesh], None] | None = None,
    input_fn: Callable[[nn.Module, Any, DeviceMesh], Any] | None = None,
    output_fn: Callable[[nn.Module, Any, DeviceMesh], Any] | None = None,
) -> nn.Module:
    """As ``torch.distributed.tensor.distribute_module``: ``partition_fn(name, submodule, mesh)`` shards what it
    chooses, every other parameter and buffer is replicated; ``input_fn``/``output_fn`` run around ``forward``.

    It works in place, once per module (a second call raises, as torch's does).
    """
    if getattr(module, "_distribute_module_applied", False):
        raise RuntimeError("distribute_module was already called on this module; call it once per module")
    mesh = device_mesh if device_mesh is not None else default_mesh(next(module.parameters(), torch.empty(0)).device.type)
    for name, submodule in module.named_modules():
        if partition_fn is not None:
            partition_fn(name, submodule, mesh)
        _replicate_rest(submodule, mesh)
    if input_fn is not None:
        module.register_forward_pre_hook(lambda mod, inputs: input_fn(mod, inputs, mesh))
    if output_fn is not None:
        module.register_forward_hook(lambda mod, inputs, outputs: output_fn(mod, outputs, mesh))
    module._distribute_module_applied = True  # type: ignore[assignment]
    return module

