"""Tensor-parallel styles: how one module's parameters, inputs and outputs are laid out on a mesh.

A style is any object with ``apply(module, device_mesh) -> nn.Module`` (subclass
``ParallelStyle``); ``parallelize_module`` accepts builtin and third-party
styles alike, or a style's registered name (see ``spmd.tensor.parallel.api``).
Names and defaults follow ``torch.distributed.tensor.parallel``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from spmd.mesh import DeviceMesh
from spmd.tensor.dtensor import DTensor, distribute_tensor
from spmd.tensor.placements import Placement, Replicate, Shard


class ParallelStyle:
    """The contract of a tensor-parallel style: ``apply(module, device_mesh)`` parallelizes ``module`` in place."""

    def apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        raise NotImplementedError


def to_dtensor(x: object, mesh: DeviceMesh, given: Placement | None, desired: Placement | None) -> object:
    """``x`` as a DTensor laid out ``desired``: a plain tensor is taken as laid out ``given``."""
    if given is None or not isinstance(x, torch.Tensor):
        return x
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [given])
    if desired is not None and tuple(x.placements) != (desired,):
        x = x.redistribute(mesh, [desired])
    return x


def from_dtensor(x: object, mesh: DeviceMesh, layout: Placement | None, use_local_output: bool) -> object:
    """``x`` redistributed to ``layout``, as its local shard if ``use_local_output``."""
    if not isinstance(x, DTensor):
        return x
    if layout is not None and tuple(x.placements) != (layout,):
        x = x.redistribute(mesh, [layout])
    return x.to_local() if use_local_output else x


def shard_parameters(module: nn.Module, mesh: DeviceMesh, layout: dict[str, Placement]) -> None:
    """Replace each named parameter of ``module`` by a DTensor parameter laid out as ``layout`` says."""
    for name, param in list(module.named_parameters(recurse=False)):
        placement = layout.get(name, Replicate())
        if isinstance(param, DTensor):
            continue
        dt = distribute_tensor(param.detach(), mesh, [placement])
        module.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))


def _input_hook(mesh: DeviceMesh, given: Placement | None, desired: Placement | None) -> Callable[..., Any]:
    def hook(module: nn.Module, args: tuple) -> tuple:
        if not args:
            return args
        return (to_dtensor(args[0], mesh, given, desired), *args[1:])

    return hook


def _output_hook(mesh: DeviceMesh, layout: Placement | None, use_local_output: bool) -> Callable[..., Any]:
    def hook(module: nn.Module, args: tuple, output: object) -> object:
        return from_dtensor(output, mesh, layout, use_local_output)

    return hook


def _check_mesh(device_mesh: DeviceMesh, style: str) -> None:
    if device_mesh.ndim != 1:
        raise ValueError(
            f"{style}: parallelize_module needs a 1-D mesh (the tensor-parallel dimension), got {device_mesh}; "
            'pass mesh["tp"]'
        )


class ColwiseParallel(ParallelStyle):
    """Split a Linear's output features (weight and bias on dim 0) or an Embedding's hidden dim (weight dim 1).

    Input replicated (taken as ``input_layouts``, default Replicate); output
    sharded on its last dimension unless ``output_layouts`` says otherwise; a
    plain tensor out by default (``use_local_output``).
    """

    def __init__(self, *, input_layouts: Placement | None = None, output_layouts: Placement | None = None,
                 use_local_output: bool = True) -> None:
        self.input_layouts = input_layouts or Replicate()
        self.output_layouts = output_layouts or Shard(-1)
        self.use_local_output = use_local_output

    def apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_mesh(device_mesh, type(self).__name__)
        if isinstance(module, nn.Linear):
            shard_parameters(module, device_mesh, {"weight": Shard(0), "bias": Shard(0)})
        elif isinstance(module, nn.Embedding):
            shard_parameters(module, device_mesh, {"weight": Shard(1)})
        else:
            raise TypeError(f"ColwiseParallel supports nn.Linear and nn.Embedding, got {type(module).__name__}")
        module.register_forward_pre_hook(_input_hook(device_mesh, self.input_layouts, Replicate()))
        module.register_forward_hook(_output_hook(device_mesh, self.output_layouts, self.use_local_output))
        return module


class RowwiseParallel(ParallelStyle):
    """Split a Linear's input features (weight on dim 1, bias replicated) or an Embedding's vocabulary (weight dim 0).

    Input sharded on its last dimension (``input_layouts``, default Shard(-1);
    an Embedding takes replicated indices); the partial output is reduced to
    ``output_layouts`` (default Replicate; Shard(1) gives a reduce-scatter for
    sequence parallelism).
    """

    def __init__(self, *, input_layouts: Placement | None = None, output_layouts: Placement | None = None,
                 use_local_output: bool = True) -> None:
        self.input_layouts = input_layouts
        self.output_layouts = output_layouts or Replicate()
        self.use_local_output = use_local_output

    def apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_mesh(device_mesh, type(self).__name__)
        if isinstance(module, nn.Linear):
            shard_parameters(module, device_mesh, {"weight": Shard(1), "bias": Replicate()})
            given: Placement = self.input_layouts or Shard(-1)
            desired: Placement = Shard(-1)
        elif isinstance(module, nn.Embedding):
            shard_parameters(module, device_mesh, {"weight": Shard(0)})
            given, desired = self.input_layouts or Replicate(), Replicate()
        else:
            raise TypeError(f"RowwiseParallel supports nn.Linear and nn.Embedding, got {type(module).__name__}")
        module.register_forward_pre_hook(_input_hook(device_mesh, given, desired))
        module.register_forward_hook(_output_hook(device_mesh, self.output_layouts, self.use_local_output))
        return module


class SequenceParallel(ParallelStyle):
    """Run a norm or dropout on activations sharded along the sequence (``sequence_dim``, default 1).

    Parameters are replicated; a plain input is taken as sharded on the
    sequence; the output stays a sequence-sharded DTensor unless ``use_local_output``.
    """

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False) -> None:
        self.sequence_dim = sequence_dim
        self.use_local_output = use_local_output

    def apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_mesh(device_mesh, type(self).__name__)
        for child in module.modules():
            shard_parameters(child, device_mesh, {})
        layout = Shard(self.sequence_dim)
        module.register_forward_pre_hook(_input_hook(device_mesh, layout, layout))
        module.register_forward_hook(_output_hook(device_mesh, layout, self.use_local_output))
        return module
