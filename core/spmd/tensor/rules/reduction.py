"""Reductions: sum, mean, amax, amin, var/std, with dims and keepdim.

Reducing over a sharded dimension leaves a partial result: sum gives
Partial(sum), amax Partial(max), amin Partial(min), mean Partial(avg) when
every shard has the same size (uneven shards are gathered first, since a mean
of unequal pieces is not the mean). var and std need the whole dimension.
"""

from __future__ import annotations

from typing import Any

import torch

from spmd.tensor.placements import Partial, Placement, Replicate, Shard, chunk_sizes
from spmd.tensor.rule import OpCall, Sharding

aten = torch.ops.aten
R = Replicate()

_PARTIAL_OF = {"sum": "sum", "amax": "max", "amin": "min", "mean": "avg"}


def reduced_dims(call: OpCall, ndim: int) -> tuple[list[int], bool]:
    """The dimensions ``call`` reduces (all when none are given) and its keepdim flag."""
    names = [a.name for a in call.op._schema.arguments]
    dims = call.arg(names.index("dim"), "dim", None) if "dim" in names else None
    keepdim = bool(call.arg(names.index("keepdim"), "keepdim", False)) if "keepdim" in names else False
    if isinstance(dims, int):
        dims = [dims]
    if not dims:
        dims = list(range(ndim))
    return sorted(d % max(ndim, 1) for d in dims), keepdim


def _out_dim(d: int, reduced: list[int], keepdim: bool) -> int:
    return d if keepdim else d - sum(1 for r in reduced if r < d)


def reduction_rule(call: OpCall) -> Sharding:
    x = call.inputs[0]
    name = call.op.__name__.split(".")[0]
    reduced, keepdim = reduced_dims(call, x.ndim)
    p: Placement = x.placement
    n_out = len(call.outputs)
    if isinstance(p, Partial):
        if name in ("sum", "mean") and p.reduce_op == "sum":
            return Sharding([p], [p] * n_out)
        if name in ("amax", "amin") and p.reduce_op == _PARTIAL_OF[name]:
            return Sharding([p], [p] * n_out)
        return Sharding([R], [R] * n_out)
    if isinstance(p, Shard):
        if p.dim not in reduced:
            return Sharding([p], [Shard(_out_dim(p.dim, reduced, keepdim))] * n_out)
        kind = _PARTIAL_OF.get(name)
        sizes = chunk_sizes(x.shape[p.dim], call.mesh_dim_size)
        nested = x.placements.count(p) > 1
        if kind == "avg" and (len(set(sizes)) != 1 or nested):
            return Sharding([R], [R] * n_out)  # a mean of unequal pieces is not the mean
        if kind in ("max", "min") and (0 in sizes or nested):
            return Sharding([R], [R] * n_out)  # amax of an empty shard is an error on that rank alone
        if kind is not None:
            return Sharding([p], [Partial(kind)] * n_out)
        return Sharding([R], [R] * n_out)
    return Sharding([R], [R] * n_out)


def rules() -> dict[Any, Any]:
    table: dict[Any, Any] = {}
    for op in (aten.sum.default, aten.sum.dim_IntList, aten.mean.default, aten.mean.dim, aten.amax.default,
               aten.amin.default, aten.var.correction, aten.std.correction, aten.var_mean.correction):
        table[op] = reduction_rule
    return table
