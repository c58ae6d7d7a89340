"""``local_map``: run a function written for plain tensors on DTensors' local shards and wrap what it returns.

torch's ``torch.distributed.tensor.experimental.local_map``, same arguments and
checks: each DTensor argument (in the flattened ``args``) must have its
``in_placements`` entry (or is redistributed to it with
``redistribute_inputs=True``); ``func`` sees the local tensors; each tensor
output becomes a DTensor with its ``out_placements`` entry on the mesh. When no
argument is a DTensor, ``func`` runs untouched and its result is returned as is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from spmd.mesh import DeviceMesh
from spmd.tensor.dtensor import DTensor
from spmd.tensor.placements import Placement

PlacementType = Sequence[Placement] | None
OutputPlacements = PlacementType | tuple[PlacementType, ...]
InputPlacements = tuple[PlacementType, ...] | None


def local_map(
    func: Callable[..., Any] | None = None,
    out_placements: OutputPlacements = None,
    in_placements: InputPlacements = None,
    in_grad_placements: InputPlacements = None,
    device_mesh: DeviceMesh | None = None,
    *,
    redistribute_inputs: bool = False,
) -> Any:
    """``func`` wrapped to take and give DTensors while computing on local shards (a decorator when ``func`` is None).

    ``out_placements``: one placement sequence for a single output, or a tuple
    with one per flattened output (None for a non-tensor). ``in_placements``: one
    per flattened argument (None for a non-tensor). ``in_grad_placements``: the
    placements of each input's gradient, when they differ from its own.
    ``device_mesh``: the outputs' mesh (default: the first DTensor argument's).
    """
    if func is None:
        return functools.partial(
            local_map,
            out_placements=out_placements,
            in_placements=in_placements,
            in_grad_placements=in_grad_placements,
            device_mesh=device_mesh,
            redistribute_inputs=redistribute_inputs,
        )
    return functools.partial(
        _local_map_wrapped, func, out_placements, in_placements, in_grad_placements, device_mesh, redistribute_inputs
    )


def _local_map_wrapped(
    func: Callable[..., Any],
    out_placements: OutputPlacements,
    in_placements: InputPlacements,
    in_grad_placements: InputPlacements,
    device_mesh: DeviceMesh | None,
    redistribute_inputs: bool,
    *args: Any,
    **kwargs: Any,
) -> Any:
    flat_args, args_spec = pytree.tree_flatten(args)
    if in_placements is not None and len(in_placements) != len(flat_args):
        raise ValueError(f"local_map: in_placements has {len(in_placements)} entries for {len(flat_args)} (flattened) arguments")
    local_args = []
    seen_dtensor = False
    for index, arg in enumerate(flat_args):
        if isinstance(arg, DTensor):
            seen_dtensor = True
            if device_mesh is None:
                device_mesh = arg.device_mesh
            if in_placements is not None:
                wanted = in_placements[index]
                if wanted is None:
                    raise ValueError(f"local_map: argument {index} is a DTensor but its in_placements entry is None")
                wanted = tuple(wanted)
                if arg.placements != wanted:
                    if not redistribute_inputs:
                        raise ValueError(
                            f"local_map: argument {index} has placements {list(arg.placements)} but in_placements asks for "
                            f"{list(wanted)}; pass redistribute_inputs=True to redistribute it"
                        )
                    arg = arg.redistribute(arg.device_mesh, wanted)
            grad = in_grad_placements[index] if in_grad_placements is not None else None
            if in_grad_placements is not None and grad is None:
                raise ValueError(f"local_map: argument {index} is a DTensor but its in_grad_placements entry is None")
            local_args.append(arg.to_local(grad_placements=tuple(grad) if grad is not None else None))
        else:
            if in_placements is not None and not isinstance(arg, torch.Tensor) and in_placements[index] is not None:
                raise ValueError(f"local_map: argument {index} ({type(arg).__name__}) is not a tensor; its in_placements entry must be None")
            local_args.append(arg)
    out = func(*pytree.tree_unflatten(local_args, args_spec), **kwargs)
    if not seen_dtensor:
        return out
    assert device_mesh is not None
    flat_out, out_spec = pytree.tree_flatten(out)
    per_output = out_placements if isinstance(out_placements, tuple) else (out_placements,)
    if len(flat_out) != len(per_output):
        raise ValueError(f"local_map: out_placements gives {len(per_output)} entries for {len(flat_out)} (flattened) outputs")
    wrapped = []
    for index, (value, placements) in enumerate(zip(flat_out, per_output)):
        if isinstance(value, DTensor):
            raise TypeError(f"local_map: output {index} of the function is a DTensor; it must return local (plain) tensors")
        if isinstance(value, torch.Tensor):
            if placements is None:
                raise ValueError(f"local_map: output {index} is a tensor but its out_placements entry is None")
            wrapped.append(DTensor.from_local(value, device_mesh, placements, run_check=False))
        else:
            if placements is not None:
                raise ValueError(f"local_map: output {index} ({type(value).__name__}) is not a tensor; its out_placements entry must be None")
            wrapped.append(value)
    return pytree.tree_unflatten(wrapped, out_spec)
