"""DTensor factories with torch's signatures: ``zeros``, ``ones``, ``empty``, ``full``, ``rand``, ``randn``.

Each builds only this rank's shard (no full tensor, no communication) for
the deterministic ones. ``rand``/``randn`` draw the whole tensor from the
default generator and distribute rank 0's draw (``distribute_tensor``'s
broadcast), so every replica agrees whatever the ranks' seeds, and the values
equal one process's ``torch.rand(size)`` under rank 0's seed. (torch's CPU
DTensor draws each shard from its own rank's generator: shards of one seed
then repeat each other.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from spmd.mesh import DeviceMesh, default_mesh
from spmd.tensor.dtensor import DTensor, distribute_tensor
from spmd.tensor.placements import Placement, Replicate
from spmd.tensor.spec import (
    DTensorSpec,
    contiguous_stride,
    local_shape_and_offset,
    normalize_placements,
)

#: A size argument as torch's factories take it: ints, or one sequence of them (``zeros(2, 3)``, ``zeros((2, 3))``).
Size = int | Sequence[int]
#: A fill value.
Number = bool | int | float | complex


def _size(size: tuple[Size, ...]) -> tuple[int, ...]:
    """torch's ``*size``: ints, or one sequence of ints."""
    first = size[0] if len(size) == 1 else None
    if isinstance(first, (list, tuple, torch.Size)):
        return tuple(int(s) for s in first)
    return tuple(int(s) for s in size)  # type: ignore[arg-type]  # (ints, or something int() takes or names)


def _layout(
    size: tuple[Size, ...], device_mesh: DeviceMesh | None, placements: Sequence[Placement] | None, layout: torch.layout
) -> tuple[tuple[int, ...], DeviceMesh, tuple[Placement, ...]]:
    if layout != torch.strided:
        raise ValueError(f"DTensor factories make strided tensors only (got layout={layout})")
    shape = _size(size)
    mesh = device_mesh if device_mesh is not None else default_mesh(torch.empty(0).device.type)
    chosen = placements if placements is not None else [Replicate()] * mesh.ndim
    return shape, mesh, normalize_placements(chosen, mesh, len(shape))


def _local(fill: Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor], size: tuple[Size, ...],
           requires_grad: bool, dtype: torch.dtype | None, layout: torch.layout, device_mesh: DeviceMesh | None,
           placements: Sequence[Placement] | None) -> DTensor:
    shape, mesh, normalized = _layout(size, device_mesh, placements, layout)
    dtype = dtype if dtype is not None else torch.get_default_dtype()
    local = fill(local_shape_and_offset(shape, mesh, normalized)[0], dtype, torch.device(mesh.device_type))
    spec = DTensorSpec(mesh, normalized, shape, contiguous_stride(shape), dtype)
    return DTensor(local, spec, requires_grad=requires_grad)


def zeros(*size: Size, requires_grad: bool = False, dtype: torch.dtype | None = None, layout: torch.layout = torch.strided,
          device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None) -> DTensor:
    """A DTensor of zeros (as ``torch.distributed.tensor.zeros``)."""
    return _local(lambda s, d, dev: torch.zeros(s, dtype=d, device=dev), size, requires_grad, dtype, layout, device_mesh, placements)


def ones(*size: Size, requires_grad: bool = False, dtype: torch.dtype | None = None, layout: torch.layout = torch.strided,
         device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None) -> DTensor:
    """A DTensor of ones (as ``torch.distributed.tensor.ones``)."""
    return _local(lambda s, d, dev: torch.ones(s, dtype=d, device=dev), size, requires_grad, dtype, layout, device_mesh, placements)


def empty(*size: Size, requires_grad: bool = False, dtype: torch.dtype | None = None, layout: torch.layout = torch.strided,
          device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None) -> DTensor:
    """An uninitialised DTensor (as ``torch.distributed.tensor.empty``)."""
    return _local(lambda s, d, dev: torch.empty(s, dtype=d, device=dev), size, requires_grad, dtype, layout, device_mesh, placements)


def full(size: Sequence[int], fill_value: Number, *, requires_grad: bool = False, dtype: torch.dtype | None = None,
         layout: torch.layout = torch.strided, device_mesh: DeviceMesh | None = None,
         placements: Sequence[Placement] | None = None) -> DTensor:
    """A DTensor filled with ``fill_value`` (as ``torch.distributed.tensor.full``)."""
    return _local(lambda s, d, dev: torch.full(s, fill_value, dtype=d, device=dev), (size,), requires_grad, dtype, layout,
                  device_mesh, placements)


def _random(draw: Callable[..., torch.Tensor], size: tuple[Size, ...], requires_grad: bool, dtype: torch.dtype | None,
            layout: torch.layout, device_mesh: DeviceMesh | None, placements: Sequence[Placement] | None) -> DTensor:
    shape, mesh, normalized = _layout(size, device_mesh, placements, layout)
    values = draw(shape, dtype=dtype, device=mesh.device_type)
    result = distribute_tensor(values, mesh, normalized)  # rank 0's draw on every rank
    result.requires_grad_(requires_grad)
    return result


def rand(*size: Size, requires_grad: bool = False, dtype: torch.dtype | None = None, layout: torch.layout = torch.strided,
         device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None) -> DTensor:
    """Uniform [0, 1) values: rank 0's ``torch.rand(size)``, distributed (every replica agrees)."""
    return _random(torch.rand, size, requires_grad, dtype, layout, device_mesh, placements)


def randn(*size: Size, requires_grad: bool = False, dtype: torch.dtype | None = None, layout: torch.layout = torch.strided,
          device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None) -> DTensor:
    """Standard normal values: rank 0's ``torch.randn(size)``, distributed (every replica agrees)."""
    return _random(torch.randn, size, requires_grad, dtype, layout, device_mesh, placements)
