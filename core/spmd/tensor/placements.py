"""Placement types: how one mesh dimension holds a tensor (Shard, Replicate, Partial).

Placements are pure, hashable values. ``Shard(dim)`` follows ``torch.chunk``:
with size ``n`` over ``k`` ranks each piece has ``ceil(n / k)`` elements and
the trailing pieces are short or empty (7 rows over 4 ranks: 2, 2, 2, 1).
"""

from __future__ import annotations

from dataclasses import dataclass

from spmd.comm.reduce_op import ReduceOp

#: Partial's reduce ops by the names torch's DTensor uses.
_PARTIAL_OPS = {"sum": ReduceOp.SUM, "avg": ReduceOp.AVG, "max": ReduceOp.MAX, "min": ReduceOp.MIN}


class Placement:
    """Base of every placement; subclasses are frozen dataclasses (hashable, comparable)."""

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self) -> bool:
        return False


@dataclass(frozen=True, repr=False)
class Shard(Placement):
    """Tensor dimension ``dim`` is split into ``torch.chunk`` pieces along the mesh dimension."""

    dim: int

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def __repr__(self) -> str:
        return f"Shard(dim={self.dim})"


@dataclass(frozen=True, repr=False)
class Replicate(Placement):
    """Every rank along the mesh dimension holds the whole tensor."""

    def is_replicate(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True, repr=False)
class Partial(Placement):
    """Each rank holds one operand of a pending reduction (``reduce_op``: sum, avg, max or min)."""

    reduce_op: str = "sum"

    def __post_init__(self) -> None:
        op = self.reduce_op
        if not isinstance(op, str):  # ReduceOp.SUM and friends are accepted too
            op = str(getattr(op, "name", op)).lower()
            object.__setattr__(self, "reduce_op", op)
        if op not in _PARTIAL_OPS:
            raise ValueError(f"Partial: unsupported reduce_op {self.reduce_op!r}; use one of {sorted(_PARTIAL_OPS)}")

    def is_partial(self) -> bool:
        return True

    @property
    def op(self) -> ReduceOp:
        """The kernel's ReduceOp for this partial's reduction."""
        return _PARTIAL_OPS[self.reduce_op]

    def __repr__(self) -> str:
        return f"Partial({self.reduce_op})"


def chunk_sizes(size: int, pieces: int) -> list[int]:
    """The sizes of ``torch.chunk(tensor of size, pieces)``, padded with zeros to ``pieces`` entries."""
    step = -(-size // pieces) if size else 0
    return [max(0, min(step, size - i * step)) for i in range(pieces)]


def chunk_offset(size: int, pieces: int, index: int) -> int:
    """Where piece ``index`` of ``chunk_sizes(size, pieces)`` starts."""
    step = -(-size // pieces) if size else 0
    return min(size, index * step)
