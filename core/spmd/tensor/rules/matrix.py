"""Matrix products: mm, addmm, bmm, baddbmm (linear and matmul decompose into these).

For ``A @ B`` with contracted dimension k, per mesh dimension: A sharded on
its rows gives rows, B sharded on its columns gives columns, A on k and B on k
gives a partial sum, one partial operand with the other replicated gives a
partial sum. When the inputs disagree the rule keeps the more sharded operand
as it is and moves the other one.
"""

from __future__ import annotations

from typing import Any

import torch

from spmd.tensor.placements import Partial, Placement, Replicate, Shard
from spmd.tensor.rule import OpCall, Sharding

aten = torch.ops.aten
R = Replicate()


def _matmul(a: Placement, b: Placement, batch: int) -> tuple[Placement, Placement, Placement]:
    """(A's placement, B's placement, output placement) for A[..., m, k] @ B[..., k, n] with ``batch`` leading dims."""
    m, k_a, k_b, n = batch, batch + 1, batch, batch + 1
    if isinstance(a, Shard) and a.dim < batch:  # batch-sharded
        return a, a, a
    if isinstance(b, Shard) and b.dim < batch:
        return b, b, b
    if a == Shard(m):
        return a, R, Shard(m)
    if b == Shard(n):
        return R, b, Shard(n)
    if a == Shard(k_a):
        return a, Shard(k_b), Partial()
    if b == Shard(k_b):
        return Shard(k_a), b, Partial()
    if isinstance(a, Partial) and a.reduce_op == "sum" and not isinstance(b, Partial):
        return a, R, a
    if isinstance(b, Partial) and b.reduce_op == "sum" and not isinstance(a, Partial):
        return R, b, b
    return R, R, R


def mm_rule(call: OpCall) -> Sharding:
    a, b = call.inputs[0], call.inputs[1]
    pa, pb, out = _matmul(a.placement, b.placement, a.ndim - 2)
    return Sharding([pa, pb], [out])


def _bias_placement(bias_ndim: int, out_ndim: int, out: Placement) -> Placement:
    if isinstance(out, Shard):
        d = out.dim - (out_ndim - bias_ndim)
        return Shard(d) if d >= 0 else R
    return out  # Partial: a replicated bias becomes partial locally (rank 0 keeps it)


def addmm_rule(call: OpCall) -> Sharding:
    """addmm(bias, A, B) and baddbmm: the bias follows the output (broadcast dims replicated)."""
    bias, a, b = call.inputs[0], call.inputs[1], call.inputs[2]
    pa, pb, out = _matmul(a.placement, b.placement, a.ndim - 2)
    out_meta = call.outputs[0]
    pbias = _bias_placement(bias.ndim, out_meta.ndim, out)
    if isinstance(pbias, Shard) and isinstance(out, Shard) and bias.shape[pbias.dim] == 1 and out_meta.shape[out.dim] != 1:
        pbias = R
    return Sharding([pbias, pa, pb], [out])


def rules() -> dict[Any, Any]:
    return {
        aten.mm.default: mm_rule,
        aten.bmm.default: mm_rule,
        aten.addmm.default: addmm_rule,
        aten.baddbmm.default: addmm_rule,
    }
