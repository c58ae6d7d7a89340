"""Redistribution: move a local shard from one list of placements to another, one mesh dimension at a time.

The plan has three phases, so that nested sharding (one tensor dimension
sharded over several mesh dimensions) stays right when several dimensions
change at once:

1. undo shards, innermost mesh dimension first (all-gather; Shard(i)->Shard(j)
   is an all-to-all when no other mesh dimension shards i or j);
2. resolve partial sums (all-reduce, or reduce-scatter straight into a Shard);
3. apply new shards and partials, outermost first (local slices, no communication).

Plans are cached per (source placements, target placements). This module works on local
tensors and specs only; ``DTensor.redistribute`` (``spmd.tensor.dtensor``) wraps it for autograd.
"""

from __future__ import annotations

import functools

import torch

from spmd.tensor import comm
from spmd.tensor.placements import Partial, Placement, Replicate, Shard, chunk_offset, chunk_sizes
from spmd.tensor.spec import DTensorSpec, size_before

#: A step: (mesh dimension, from, to).
Step = tuple[int, Placement, Placement]


@functools.lru_cache(maxsize=4096)
def plan(src: tuple[Placement, ...], dst: tuple[Placement, ...]) -> tuple[Step, ...]:
    """The ordered transitions that take placements ``src`` to ``dst``."""
    n = len(src)
    cur = list(src)
    unshard = [False] * n
    for i in range(n):
        c = cur[i]
        if not isinstance(c, Shard):
            continue
        if c != dst[i]:
            unshard[i] = True
        for j in range(i):  # an outer change on the same tensor dim re-chunks this inner shard
            target = dst[j]
            if (unshard[j] and cur[j] == c) or (cur[j] != target and isinstance(target, Shard) and target.dim == c.dim):
                unshard[i] = True
    steps: list[Step] = []

    def others_shard(i: int, *dims: int) -> bool:
        return any(
            j != i and isinstance(p, Shard) and p.dim in dims for j in range(n) for p in (cur[j], dst[j])
        )

    for i in reversed(range(n)):
        if not unshard[i]:
            continue
        c, t = cur[i], dst[i]
        assert isinstance(c, Shard)
        if isinstance(t, Shard) and t != c and not others_shard(i, c.dim, t.dim):
            steps.append((i, c, t))
            cur[i] = t
        else:
            steps.append((i, c, Replicate()))
            cur[i] = Replicate()
    for i in range(n):
        c, t = cur[i], dst[i]
        if isinstance(c, Partial) and c != t:
            if isinstance(t, Shard) and not others_shard(i, t.dim):
                steps.append((i, c, t))
                cur[i] = t
            else:
                steps.append((i, c, Replicate()))
                cur[i] = Replicate()
    for i in range(n):
        c, t = cur[i], dst[i]
        if c != t:
            assert isinstance(c, Replicate), (src, dst, cur)
            steps.append((i, c, t))
            cur[i] = t
    return tuple(steps)


def redistribute_local(local: torch.Tensor, spec: DTensorSpec, dst: tuple[Placement, ...]) -> torch.Tensor:
    """``local`` (this rank's shard under ``spec``) as this rank's shard under placements ``dst``."""
    if spec.placements == dst:
        return local
    conj, neg = local.is_conj(), local.is_neg()
    if conj or neg:
        # collectives move stored bytes: move the stored values and put the lazy bits back after (no copy), unless
        # a reduction is not linear (the max of negations is not the negation of the max): then apply them first
        if any(isinstance(p, Partial) and p.reduce_op not in ("sum", "avg") for p in spec.placements):
            local, conj, neg = local.resolve_conj().resolve_neg(), False, False
        else:
            local = _flip_bits(local, conj, neg)
    local = _redistribute_stored(local, spec, dst)
    return _flip_bits(local, conj, neg) if conj or neg else local


def _flip_bits(local: torch.Tensor, conj: bool, neg: bool) -> torch.Tensor:
    """``local`` with its conjugate and/or negative bit flipped: a view of the same memory."""
    if conj:
        local = local.conj()
    if neg:
        local = torch._neg_view(local)
    return local


def _redistribute_stored(local: torch.Tensor, spec: DTensorSpec, dst: tuple[Placement, ...]) -> torch.Tensor:
    """``redistribute_local`` on a tensor without math bits."""
    mesh = spec.mesh
    coordinate = mesh.get_coordinate()
    assert coordinate is not None, "redistribute on a rank outside the mesh"
    placements = list(spec.placements)
    for mesh_dim, src_p, dst_p in plan(spec.placements, dst):
        group = mesh.get_group(mesh_dim)
        n = group.size
        me = coordinate[mesh_dim]
        if isinstance(src_p, Shard):
            size = size_before(spec.shape, mesh, tuple(placements), mesh_dim, src_p.dim)
            sizes = chunk_sizes(size, n)
            if isinstance(dst_p, Shard):
                dst_size = size_before(spec.shape, mesh, tuple(placements), mesh_dim, dst_p.dim)
                local = comm.all_to_all(local, src_p.dim, dst_p.dim, group, sizes, chunk_sizes(dst_size, n))
            else:
                local = comm.all_gather(local, src_p.dim, group, sizes)
        elif isinstance(src_p, Partial):
            if isinstance(dst_p, Shard):
                size = size_before(spec.shape, mesh, tuple(placements), mesh_dim, dst_p.dim)
                local = comm.reduce_scatter(local, dst_p.dim, group, src_p.op, chunk_sizes(size, n))
            else:
                local = comm.all_reduce(local, group, src_p.op)
        elif isinstance(dst_p, Shard):
            size = local.size(dst_p.dim)
            local = local.narrow(dst_p.dim, chunk_offset(size, n, me), chunk_sizes(size, n)[me])
        elif isinstance(dst_p, Partial):
            if dst_p.reduce_op == "sum" and me != 0:
                local = torch.zeros_like(local)
        placements[mesh_dim] = dst_p
    return local


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether non-empty ``a`` lives in ``b``'s storage (a view of it, not a copy)."""
    return a.numel() > 0 and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
