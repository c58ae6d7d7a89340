"""Neural-network ops: softmax, layer norm, embedding, losses, dropout, attention (forward and backward)."""

from __future__ import annotations

from typing import Any

import torch

from spmd.tensor.placements import Partial, Placement, Replicate, Shard
from spmd.tensor.rule import Decompose, OpCall, Sharding

aten = torch.ops.aten
R = Replicate()


def _shard_except(call: OpCall, forbidden: set[int]) -> Sharding:
    """Every DTensor input takes the first input's shard unless it is on a forbidden dim (then all replicate)."""
    first = call.inputs[0]
    p = first.placement
    n_in, n_out = len(call.inputs), len(call.outputs)
    if isinstance(p, Shard) and p.dim not in forbidden:
        return Sharding([p if x.ndim == first.ndim else R for x in call.inputs], [p] * n_out)
    return Sharding([R] * n_in, [R] * n_out)


def softmax_rule(call: OpCall) -> Sharding:
    """_softmax/_log_softmax and their backward: the softmax dimension must be whole."""
    ndim = call.inputs[0].ndim
    dim = call.arg(1, "dim") if call.op in (aten._softmax.default, aten._log_softmax.default) else call.arg(2, "dim")
    return _shard_except(call, {dim % ndim if ndim else 0})


def layer_norm_rule(call: OpCall) -> Sharding:
    """native_layer_norm(x, normalized_shape, w, b, eps) -> (y, mean, rstd): batch dims may stay sharded."""
    x = call.inputs[0]
    normalized = len(call.arg(1, "normalized_shape"))
    p = x.placement
    others = [R] * (len(call.inputs) - 1)
    if isinstance(p, Shard) and p.dim < x.ndim - normalized:
        return Sharding([p, *others], [p, p, p])
    return Sharding([R, *others], [R, R, R])


def layer_norm_backward_rule(call: OpCall) -> Sharding:
    """native_layer_norm_backward(grad, x, shape, mean, rstd, w, b, mask) -> (dx, dw, db): dw, db partial sums."""
    grad = call.inputs[0]
    normalized = len(call.arg(2, "normalized_shape"))
    p = grad.placement
    n_in = len(call.inputs)
    n_out = len(call.outputs)
    batch = grad.ndim - normalized
    mask = list(call.arg(7, "output_mask", [True, True, True]))
    if isinstance(p, Shard) and p.dim < batch:
        wanted = [p, p, p, p] + [R] * (n_in - 4)
        every: list[Placement] = [p, Partial(), Partial()]  # outputs left out by output_mask are None
        return Sharding(wanted, [q for q, present in zip(every, mask) if present][:n_out])
    return Sharding([R] * n_in, [R] * n_out)


def embedding_rule(call: OpCall) -> Sharding:
    """embedding(weight, indices): sharded indices shard the output; a column-sharded table shards the last dim."""
    weight, indices = call.inputs[0], call.inputs[1]
    if isinstance(indices.placement, Shard):
        return Sharding([R, indices.placement], [indices.placement])
    if weight.placement == Shard(1):
        return Sharding([weight.placement, R], [Shard(indices.ndim)])
    return Sharding([R, R], [R])


def _embedding(weight: Any, indices: Any, *rest: Any) -> Any:
    """Vocabulary-parallel embedding (weight rows sharded on one mesh dim, indices replicated): each rank
    looks up the rows it holds, zeros the others, and the result is a partial sum. Other layouts: the rule."""
    from spmd.tensor.dispatch import dispatcher
    from spmd.tensor.dtensor import DTensor
    from spmd.tensor.spec import DTensorSpec, contiguous_stride, local_shape_and_offset

    spec = weight._spec if isinstance(weight, DTensor) else None
    row_dims = [m for m, p in enumerate(spec.placements) if p == Shard(0)] if spec else []
    replicated_indices = isinstance(indices, DTensor) and all(isinstance(p, Replicate) for p in indices.placements)
    if spec is None or len(row_dims) != 1 or not replicated_indices or rest and rest[0] != -1 or any(
        not isinstance(p, Replicate) for m, p in enumerate(spec.placements) if m != row_dims[0]
    ):
        return dispatcher.dispatch_by_rule(aten.embedding.default, (weight, indices, *rest), {}, embedding_rule)
    shape, offset = local_shape_and_offset(spec.shape, spec.mesh, spec.placements)
    ids = indices._local_tensor
    here = (ids >= offset[0]) & (ids < offset[0] + shape[0])
    local_ids = (ids - offset[0]).clamp(0, max(shape[0] - 1, 0))
    rows = weight._local_tensor
    if shape[0]:
        out = aten.embedding.default(rows, local_ids) * here.unsqueeze(-1).to(rows.dtype)
    else:
        out = rows.new_zeros((*ids.shape, spec.shape[1]))
    placements = tuple(Partial() if m == row_dims[0] else R for m in range(spec.mesh.ndim))
    out_shape = tuple(out.shape)
    return DTensor(out, DTensorSpec(spec.mesh, placements, out_shape, contiguous_stride(out_shape), out.dtype))


def embedding_backward_rule(call: OpCall) -> Sharding:
    """embedding_dense_backward(grad, indices, ...): batch-sharded gives a partial sum; hidden-sharded shards dim 1."""
    grad, indices = call.inputs[0], call.inputs[1]
    p = grad.placement
    if isinstance(p, Shard) and p.dim < indices.ndim:
        return Sharding([p, Shard(p.dim)], [Partial()])
    if isinstance(p, Shard) and p.dim == grad.ndim - 1:
        return Sharding([p, R], [Shard(1)])
    if isinstance(p, Partial):
        return Sharding([p, R], [p])
    return Sharding([R, R], [R])


def nll_loss_backward_rule(call: OpCall) -> Sharding:
    """nll_loss_backward(grad, x, target, weight, reduction, ignore_index, total_weight): rows stay sharded."""
    inputs = call.inputs
    x = inputs[1]
    p = x.placement
    n_in = len(inputs)
    if isinstance(p, Shard) and p.dim == 0 and x.ndim == 2:
        reduction = call.arg(4, "reduction")
        grad_p: Placement = Shard(0) if reduction == 0 else R
        wanted = [grad_p, p, Shard(0)] + [R] * (n_in - 3)
        return Sharding(wanted, [p])
    return Sharding([R] * n_in, [R])


def _nll_loss_forward(x: Any, target: Any, weight: Any, reduction: int, ignore_index: int) -> Any:
    """Row-sharded nll_loss: a local sum over this rank's rows divided by the global total weight."""
    from spmd.tensor import comm
    from spmd.tensor.dtensor import DTensor
    from spmd.tensor.redistribute import redistribute_local
    from spmd.tensor.spec import DTensorSpec, contiguous_stride

    spec = x._spec
    mesh = spec.mesh
    replicate = (R,) * mesh.ndim

    def local(t: Any, placements: tuple[Placement, ...]) -> Any:
        return redistribute_local(t._local_tensor, t._spec, placements) if isinstance(t, DTensor) else t

    def wrap(t: torch.Tensor, placements: tuple[Placement, ...]) -> DTensor:
        shape = tuple(t.shape)
        return DTensor(t, DTensorSpec(mesh, placements, shape, contiguous_stride(shape), t.dtype))

    sharded = [d for d, p in enumerate(spec.placements) if p == Shard(0)]
    others_fine = all(isinstance(p, Replicate) or p == Shard(0) for p in spec.placements)
    if not sharded or x.ndim != 2 or reduction == 0 or not others_fine or not isinstance(target, DTensor):
        out, total = aten.nll_loss_forward.default(
            local(x, replicate), local(target, replicate), local(weight, replicate), reduction, ignore_index
        )
        return wrap(out, replicate), wrap(total, replicate)
    local_sum, local_total = aten.nll_loss_forward.default(
        x._local_tensor, local(target, spec.placements), local(weight, replicate), 2, ignore_index
    )
    total = local_total
    for d in sharded:
        total = comm.all_reduce(total, mesh.get_group(d), Partial().op)
    if reduction == 1:  # mean: each rank's sum over the global weight is one summand of the loss
        local_sum = local_sum / total
    partial = tuple(Partial() if isinstance(p, Shard) else R for p in spec.placements)
    return wrap(local_sum, partial), wrap(total, replicate)


def dropout_rule(call: OpCall) -> Sharding:
    """native_dropout(x, p, train) -> (y, mask): elementwise, so any shard stays; a partial sum is resolved."""
    p = call.inputs[0].placement
    if isinstance(p, Partial):
        p = R
    return Sharding([p], [p, p])


def attention_rule(call: OpCall) -> Sharding:
    """CPU flash attention forward/backward: batch (dim 0) or heads (dim 1) sharded on every input (evenly)."""
    q = next(x for x in call.inputs if x.ndim == 4)
    p = q.placement
    # torch's CPU flash kernel dies with SIGFPE on an empty shard: shard only when no piece is empty
    even = isinstance(p, Shard) and q.shape[p.dim] % call.mesh_dim_size == 0 and q.placements.count(p) == 1
    if isinstance(p, Shard) and p.dim in (0, 1) and even:
        wanted: list[Placement] = []
        for x in call.inputs:
            if x.ndim >= 3 and x.shape[p.dim] == q.shape[p.dim] and x.shape[p.dim] != 1:
                wanted.append(p)
            else:
                wanted.append(R)
        return Sharding(wanted, [p] * len(call.outputs))
    return Sharding([R] * len(call.inputs), [R] * len(call.outputs))


def rules() -> dict[Any, Any]:
    return {
        aten._softmax.default: softmax_rule,
        aten._log_softmax.default: softmax_rule,
        aten._softmax_backward_data.default: softmax_rule,
        aten._log_softmax_backward_data.default: softmax_rule,
        aten.native_layer_norm.default: layer_norm_rule,
        aten.native_layer_norm_backward.default: layer_norm_backward_rule,
        aten.embedding.default: Decompose(_embedding),
        aten.embedding_dense_backward.default: embedding_backward_rule,
        aten.nll_loss_forward.default: Decompose(_nll_loss_forward),
        aten.nll_loss_backward.default: nll_loss_backward_rule,
        aten.native_dropout.default: dropout_rule,
        aten._scaled_dot_product_flash_attention_for_cpu.default: attention_rule,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default: attention_rule,
    }
