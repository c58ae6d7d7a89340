"""loss_parallel(): cross-entropy on logits sharded over the class dimension, without gathering them.

    with loss_parallel():
        loss = F.cross_entropy(logits, target)     # logits: DTensor sharded on the class dim
        loss.backward()

Inside the context, log_softmax over a sharded class dimension reduces its
max and sum of exponentials across the ranks (two small all-reduces), and
nll_loss picks each target's log-probability on the rank that holds it. The
backward ops are handled the same way, so ``backward()`` belongs inside too.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from spmd.comm.reduce_op import ReduceOp
from spmd.tensor import comm
from spmd.tensor.dispatch import dispatcher
from spmd.tensor.dtensor import DTensor
from spmd.tensor.placements import Placement, Replicate, Shard
from spmd.tensor.spec import DTensorSpec, contiguous_stride, local_shape_and_offset

aten = torch.ops.aten


def _class_mesh_dim(x: Any, dim: int) -> int | None:
    """The one mesh dimension that shards ``x`` on ``dim`` while the others replicate it, else None."""
    if not isinstance(x, DTensor):
        return None
    dim = dim % x.ndim
    sharding = [m for m, p in enumerate(x.placements) if p == Shard(dim)]
    others_replicated = all(isinstance(p, Replicate) or p == Shard(dim) for p in x.placements)
    return sharding[0] if len(sharding) == 1 and others_replicated else None


def _wrap(local: torch.Tensor, like: DTensorSpec, placements: tuple[Placement, ...], shape: tuple[int, ...]) -> DTensor:
    return DTensor(local, DTensorSpec(like.mesh, placements, shape, contiguous_stride(shape), local.dtype))


def _log_softmax(x: Any, dim: int, half_to_float: bool) -> Any:
    m = _class_mesh_dim(x, dim)
    if m is None:
        return dispatcher.dispatch_by_rule(aten._log_softmax.default, (x, dim, half_to_float), {})
    group = x.device_mesh.get_group(m)
    local = x._local_tensor
    if local.size(dim):
        top = local.amax(dim, keepdim=True)
    else:  # this rank holds no classes (9 classes on 4 ranks): it still joins the reduction, with -inf
        top = local.new_full([1 if d == dim % local.ndim else n for d, n in enumerate(local.shape)], float("-inf"))
    top = comm.all_reduce(top, group, ReduceOp.MAX)
    shifted = local - top
    total = comm.all_reduce(shifted.exp().sum(dim, keepdim=True), group, ReduceOp.SUM)
    return _wrap(shifted - total.log(), x._spec, x.placements, tuple(x.shape))


def _log_softmax_backward(grad: Any, output: Any, dim: int, input_dtype: Any) -> Any:
    m = _class_mesh_dim(output, dim)
    if m is None or not isinstance(grad, DTensor) or grad.placements != output.placements:
        return dispatcher.dispatch_by_rule(aten._log_softmax_backward_data.default, (grad, output, dim, input_dtype), {})
    group = output.device_mesh.get_group(m)
    g = grad._local_tensor
    total = comm.all_reduce(g.sum(dim, keepdim=True), group, ReduceOp.SUM)
    return _wrap(g - output._local_tensor.exp() * total, output._spec, output.placements, tuple(output.shape))


def _local_targets(x: DTensor, target: Any, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets as indices into this rank's classes, and the mask of rows whose target lives here."""
    shape, offset = local_shape_and_offset(tuple(x.shape), x.device_mesh, x.placements)
    t = target.full_tensor() if isinstance(target, DTensor) else target
    start, size = offset[1], shape[1]
    here = (t >= start) & (t < start + size) & (t != ignore_index)
    return (t - start).clamp(0, max(size - 1, 0)), here


def _nll_loss_forward(x: Any, target: Any, weight: Any, reduction: int, ignore_index: int) -> Any:
    m = _class_mesh_dim(x, 1)
    if m is None or x.ndim != 2 or weight is not None:
        return dispatcher.dispatch_by_rule(aten.nll_loss_forward.default, (x, target, weight, reduction, ignore_index), {})
    group = x.device_mesh.get_group(m)
    index, here = _local_targets(x, target, ignore_index)
    local = x._local_tensor
    picked = local.gather(1, index.unsqueeze(1)).squeeze(1) * here if local.shape[1] else local.new_zeros(local.shape[0])
    per_row = comm.all_reduce(-picked, group, ReduceOp.SUM)
    t = target.full_tensor() if isinstance(target, DTensor) else target
    total = (t != ignore_index).sum().to(local.dtype)
    out = per_row if reduction == 0 else per_row.sum() if reduction == 2 else per_row.sum() / total
    replicate = (Replicate(),) * x.device_mesh.ndim
    return _wrap(out, x._spec, replicate, tuple(out.shape)), _wrap(total, x._spec, replicate, ())


def _nll_loss_backward(grad: Any, x: Any, target: Any, weight: Any, reduction: int, ignore_index: int, total_weight: Any) -> Any:
    m = _class_mesh_dim(x, 1)
    if m is None or x.ndim != 2 or weight is not None:
        return dispatcher.dispatch_by_rule(aten.nll_loss_backward.default, (grad, x, target, weight, reduction, ignore_index, total_weight), {})
    index, here = _local_targets(x, target, ignore_index)
    g = grad.full_tensor() if isinstance(grad, DTensor) else grad
    if reduction == 1:
        tw = total_weight.full_tensor() if isinstance(total_weight, DTensor) else total_weight
        g = g / tw
    scale = (g if reduction == 0 else g.expand(here.shape)) * here
    local = torch.zeros_like(x._local_tensor)
    if local.shape[1]:
        local.scatter_(1, index.unsqueeze(1), -scale.unsqueeze(1).to(local.dtype))
    return _wrap(local, x._spec, x.placements, tuple(x.shape))


_OVERRIDES: dict[torch._ops.OpOverload, Callable[..., object]] = {
    aten._log_softmax.default: _log_softmax,
    aten._log_softmax_backward_data.default: _log_softmax_backward,
    aten.nll_loss_forward.default: _nll_loss_forward,
    aten.nll_loss_backward.default: _nll_loss_backward,
}


def loss_parallel() -> AbstractContextManager[None]:
    """Compute cross-entropy (forward and backward) on class-sharded logits without gathering them."""
    return dispatcher.overriding(_OVERRIDES)
