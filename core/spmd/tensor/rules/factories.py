"""Factories and copies: the *_like ops, new_* ops, copy_, zero_."""

from __future__ import annotations

from typing import Any

import torch

from spmd.tensor.placements import Partial, Placement, Replicate, Shard
from spmd.tensor.rule import LocalInfo, OpCall, Sharding, aligned_dim

aten = torch.ops.aten
R = Replicate()


def like_rule(call: OpCall) -> Sharding:
    """zeros_like and friends: the input's placement, except that a partial input gives a replicated result
    (ones on every rank would sum to N); zeros and uninitialised memory stay partial."""
    p = call.inputs[0].placement
    keeps_partial = call.op in (aten.zeros_like.default, aten.empty_like.default)
    out: Placement = p if not isinstance(p, Partial) or keeps_partial else R
    return Sharding([p], [out])


def _local_size_and_stride(args: tuple, kwargs: dict, info: LocalInfo) -> tuple[tuple, dict]:
    shape = list(info.out_shapes[0])
    args = list(args)  # type: ignore[assignment]
    args[1] = shape  # type: ignore[index]
    if len(args) > 2 and isinstance(args[2], (list, tuple)) and args[0] is not None:
        stride, acc = [], 1
        for size in reversed(shape):
            stride.append(acc)
            acc *= max(size, 1)
        args[2] = list(reversed(stride))  # type: ignore[index]
    return tuple(args), kwargs


def new_factory_rule(call: OpCall) -> Sharding:
    """new_empty/new_zeros/new_ones/new_full/new_empty_strided: the input's placement when the requested
    size is the input's global shape (autograd's gradient buffers), else a replicated tensor of that size."""
    x = call.inputs[0]
    size = tuple(call.arg(1, "size"))
    p = x.placement
    if size == x.shape and not isinstance(p, Partial):
        return Sharding([p], [p], _local_size_and_stride)
    return Sharding([p], [R], _local_size_and_stride)


def copy_rule(call: OpCall) -> Sharding:
    """copy_(self, src): self keeps its placement and src is moved to match it; a src that broadcasts to
    self's shape is sharded on its own aligned dimension, or replicated along a broadcast one."""
    x = call.inputs[0]
    p = x.placement
    if not isinstance(p, Shard):
        return Sharding([p] * len(call.inputs), [p])
    wanted: list[Placement] = [p]
    for src in call.inputs[1:]:
        d = aligned_dim(src, x.ndim, x.shape, p.dim)
        wanted.append(Shard(d) if d is not None else Replicate())
    return Sharding(wanted, [p])


def keep_rule(call: OpCall) -> Sharding:
    """zero_ and similar: any placement stays, partial included."""
    p = call.inputs[0].placement
    return Sharding([p], [p] * len(call.outputs))


def rules() -> dict[Any, Any]:
    table: dict[Any, Any] = {}
    for name in ("zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like"):
        for overload in getattr(aten, name).overloads():
            if "out" not in overload:
                table[getattr(getattr(aten, name), overload)] = like_rule
    for op in (aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default,
               aten.new_empty_strided.default):
        table[op] = new_factory_rule
    table[aten.copy_.default] = copy_rule
    table[aten.zero_.default] = keep_rule
    return table
