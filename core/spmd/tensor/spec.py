"""DTensorSpec: a DTensor's mesh, placements and global metadata, and where this rank's shard lies."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from spmd.mesh import DeviceMesh
from spmd.tensor.placements import Partial, Placement, Replicate, Shard, chunk_offset, chunk_sizes

#: Every (placements, shape, stride, dtype) seen, numbered: as many entries as distinct layouts in the job.
_LAYOUT_KEYS: dict[tuple, int] = {}
_LAYOUT_LOCK = threading.Lock()


@dataclass(frozen=True)
class DTensorSpec:
    """Everything about a DTensor except its local data; hashable, used as a cache key."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    #: (placements, shape, stride, dtype) as a small int, for the dispatcher's cache keys: computed once
    #: per spec, and cheap to hash (a tuple of placements re-hashes each placement in Python every time).
    key: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        layout = (self.placements, self.shape, self.stride, self.dtype)
        key = _LAYOUT_KEYS.get(layout)
        if key is None:
            with _LAYOUT_LOCK:  # two threads must never number two layouts alike
                key = _LAYOUT_KEYS.setdefault(layout, len(_LAYOUT_KEYS))
        object.__setattr__(self, "key", key)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def local_shape(self) -> tuple[int, ...]:
        """The shape of this rank's shard."""
        return local_shape_and_offset(self.shape, self.mesh, self.placements)[0]

    def with_placements(self, placements: tuple[Placement, ...]) -> DTensorSpec:
        return DTensorSpec(self.mesh, placements, self.shape, self.stride, self.dtype)


def local_shape_and_offset(
    shape: tuple[int, ...], mesh: DeviceMesh, placements: tuple[Placement, ...], coordinate: list[int] | None = None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's (or ``coordinate``'s) shard shape and its offset in the global tensor.

    Nested sharding (one tensor dimension sharded over several mesh dimensions)
    chunks in mesh-dimension order: mesh dimension 1 chunks mesh dimension 0's piece.
    """
    coord = coordinate if coordinate is not None else mesh.get_coordinate()
    if coord is None:
        return (0,) * len(shape), (0,) * len(shape)
    sizes = list(shape)
    offsets = [0] * len(shape)
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            d = placement.dim
            n = mesh.mesh.shape[mesh_dim]
            offsets[d] += chunk_offset(sizes[d], n, coord[mesh_dim])
            sizes[d] = chunk_sizes(sizes[d], n)[coord[mesh_dim]]
    return tuple(sizes), tuple(offsets)


def local_piece(full: torch.Tensor, spec: DTensorSpec) -> torch.Tensor:
    """This rank's piece of the global tensor ``full`` under ``spec`` (a view; Partial is taken as Replicate)."""
    sizes, offsets = local_shape_and_offset(spec.shape, spec.mesh, spec.placements)
    return full[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]


def holds_zero_summand(spec: DTensorSpec, coordinate: tuple[int, ...] | list[int]) -> bool:
    """Whether this rank's piece of a full value placed under ``spec`` is zeros: along a Partial("sum") mesh
    dimension only the first rank holds the value (the sum is then the value); avg, max and min hold it everywhere."""
    return any(isinstance(p, Partial) and p.reduce_op == "sum" and coordinate[d] != 0 for d, p in enumerate(spec.placements))


def size_before(shape: tuple[int, ...], mesh: DeviceMesh, placements: tuple[Placement, ...], mesh_dim: int, dim: int) -> int:
    """The size of tensor dimension ``dim`` that mesh dimension ``mesh_dim`` chunks (after the outer ones)."""
    coord = mesh.get_coordinate()
    assert coord is not None
    size = shape[dim]
    for outer in range(mesh_dim):
        placement = placements[outer]
        if isinstance(placement, Shard) and placement.dim == dim:
            size = chunk_sizes(size, mesh.mesh.shape[outer])[coord[outer]]
    return size


def normalize_placements(placements: object, mesh: DeviceMesh, ndim: int) -> tuple[Placement, ...]:
    """Placements as a tuple, one per mesh dimension, with negative Shard dims resolved; clear errors otherwise."""
    if isinstance(placements, Placement):
        placements = (placements,)
    result: tuple[Placement, ...] = tuple(placements)  # type: ignore[arg-type]
    if len(result) != mesh.ndim:
        raise ValueError(
            f"{len(result)} placements {list(result)} for a {mesh.ndim}-D mesh; give one placement per mesh "
            f"dimension (e.g. [Shard(0)] + [Replicate()] * {mesh.ndim - 1})"
        )
    out = []
    for p in result:
        if not isinstance(p, Placement):
            raise TypeError(f"placements must be spmd.Shard, spmd.Replicate or spmd.Partial values, got {p!r}")
        if isinstance(p, Shard):
            if not -ndim <= p.dim < max(ndim, 1):
                raise ValueError(f"{p} is out of range for a tensor with {ndim} dimensions")
            if p.dim < 0:
                p = Shard(p.dim % ndim)
        out.append(p)
    return tuple(out)


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


def global_stride(local: torch.Tensor, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A global stride with the same dimension order as the local tensor's (contiguous in that order)."""
    if local.is_contiguous() or local.ndim < 2:
        return contiguous_stride(shape)
    strides = local.stride()
    order = sorted(range(local.ndim), key=lambda d: (-strides[d], -d))
    stride = [0] * len(shape)
    acc = 1
    for d in reversed(order):
        stride[d] = acc
        acc *= max(shape[d], 1)
    return tuple(stride)


REPLICATE = Replicate()
