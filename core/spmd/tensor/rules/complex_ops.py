"""Complex numbers and math bits: conjugation, negation views, and views between complex and real dtypes.

A DTensor keeps its shard's conjugate and negative bits (``is_conj``,
``is_neg``); these ops set or resolve them on the local shard. Conjugation and
negation are linear, so partial sums pass through. ``view_as_real`` adds a
last dimension of 2 and ``view_as_complex`` removes it: a shard on any other
dimension survives, one on the pair dimension is gathered first.
``view(dtype)`` reinterprets bits, which is not linear: a partial sum is
resolved first, and a shard on the last dimension is gathered when the
element size changes.
"""

from __future__ import annotations

from typing import Any

import torch

from spmd.tensor.placements import Partial, Replicate, Shard
from spmd.tensor.rule import OpCall, Sharding, linear_pointwise_rule, pointwise_rule

aten = torch.ops.aten
R = Replicate()

#: Unary and linear: the conjugate and negative bits, set lazily or resolved.
LINEAR_UNARY = ["_conj", "conj_physical", "_neg_view", "resolve_conj", "resolve_neg", "_conj_copy", "_neg_view_copy"]

#: Elementwise between real and complex (angle, polar, complex): a partial sum is resolved first.
ELEMENTWISE = ["angle", "polar", "complex"]


def view_as_real_rule(call: OpCall) -> Sharding:
    """Every placement survives: the new last dimension is local to each element."""
    p = call.inputs[0].placement
    return Sharding([p], [p])


def view_as_complex_rule(call: OpCall) -> Sharding:
    """A shard on the (real, imaginary) pair dimension is gathered; any other placement survives."""
    x = call.inputs[0]
    p = x.placement
    if isinstance(p, Shard) and p.dim == x.ndim - 1:
        return Sharding([R], [R])
    return Sharding([p], [p])


def view_dtype_rule(call: OpCall) -> Sharding:
    """Bits reinterpreted: partial sums resolved; a shard on the last dimension kept only if element sizes match."""
    x = call.inputs[0]
    p = x.placement
    if isinstance(p, Partial):
        return Sharding([R], [R])
    resized = call.outputs[0].dtype.itemsize != x.dtype.itemsize
    if isinstance(p, Shard) and resized and p.dim == x.ndim - 1:
        return Sharding([R], [R])
    return Sharding([p], [p])


def _overloads(names: list[str]) -> list[Any]:
    found: list[Any] = []
    for name in names:
        packet = getattr(aten, name, None)
        if packet is None:
            continue
        found.extend(getattr(packet, o) for o in packet.overloads() if "out" not in o)
    return found


def rules() -> dict[Any, Any]:
    table: dict[Any, Any] = {op: linear_pointwise_rule for op in _overloads(LINEAR_UNARY)}
    table.update({op: pointwise_rule for op in _overloads(ELEMENTWISE)})
    table[aten.view_as_real.default] = view_as_real_rule
    table[aten.view_as_complex.default] = view_as_complex_rule
    table[aten.view.dtype] = view_dtype_rule
    return table
