"""Shape ops: view/reshape, transpose/permute, expand, (un)squeeze, split/chunk/unbind, cat/stack, slice/select.

A shard survives a shape op when its dimension maps onto one output dimension
whose ``torch.chunk`` pieces are the same elements: a dimension kept as is,
the leading dimension of a merge (evenly divisible), or the leading dimension
of a split (evenly divisible). Otherwise the input is gathered first. Partial
sums pass through (shape ops are linear). Size arguments are rewritten to the
local shapes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from spmd.tensor.errors import InPlaceViewError
from spmd.tensor.placements import Partial, Placement, Replicate, Shard
from spmd.tensor.redistribute import shares_memory
from spmd.tensor.rule import Decompose, LocalInfo, OpCall, Sharding, TensorArg

aten = torch.ops.aten
R = Replicate()


def _dim_rule(map_dim: Callable[[OpCall, int], int | None]) -> Callable[[OpCall], Sharding]:
    """A rule for one-input shape ops: ``map_dim(call, d)`` is where input dim ``d`` goes (None: gather it)."""

    def rule(call: OpCall) -> Sharding:
        x = call.inputs[0]
        n_out = len(call.outputs)
        p = x.placement
        others = [R] * (len(call.inputs) - 1)  # index tensors and the like stay replicated
        if isinstance(p, Shard):
            d = map_dim(call, p.dim)
            if d is None:
                return Sharding([R, *others], [R] * n_out)
            return Sharding([p, *others], [Shard(d)] * n_out)
        return Sharding([p, *others], [p] * n_out)

    return rule


def _norm(dim: int, ndim: int) -> int:
    return dim % ndim if ndim else 0


def _groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Pair runs of input and output dimensions whose sizes multiply to the same number."""
    groups = []
    i = j = 0
    while i < len(src) or j < len(dst):
        ins: list[int] = []
        outs: list[int] = []
        pi = pj = 1
        if i < len(src):
            ins.append(i)
            pi *= src[i]
            i += 1
        if j < len(dst):
            outs.append(j)
            pj *= dst[j]
            j += 1
        while pi != pj and (i < len(src) or j < len(dst)):
            if (pi < pj and i < len(src)) or j >= len(dst):
                ins.append(i)
                pi *= src[i]
                i += 1
            else:
                outs.append(j)
                pj *= dst[j]
                j += 1
        groups.append((ins, outs))
    return groups


def _view_dim(call: OpCall, d: int) -> int | None:
    x: TensorArg = call.inputs[0]
    src, dst = x.shape, call.outputs[0].shape
    n = call.mesh_dim_size
    if sum(1 for q in x.placements if q == Shard(d)) > 1:
        return None  # nested sharding of one dimension: gather rather than reason about re-chunking
    for ins, outs in _groups(src, dst):
        if d not in ins:
            continue
        big_in = [k for k in ins if src[k] != 1]
        big_out = [k for k in outs if dst[k] != 1]
        if not big_in or not big_out or big_in[0] != d:
            return None
        e = big_out[0]
        if len(big_in) == 1 and len(big_out) == 1:
            return e
        if len(big_in) > 1 and len(big_out) == 1 and src[d] % n == 0:
            return e
        if len(big_in) == 1 and len(big_out) > 1 and dst[e] % n == 0:
            return e
        return None
    return None


def _with_local_size(index: int, name: str) -> Callable[[tuple, dict, LocalInfo], tuple[tuple, dict]]:
    def rewrite(args: tuple, kwargs: dict, info: LocalInfo) -> tuple[tuple, dict]:
        if index < len(args):
            args = (*args[:index], list(info.out_shapes[0]), *args[index + 1 :])
        else:
            kwargs = {**kwargs, name: list(info.out_shapes[0])}
        return args, kwargs

    return rewrite


def _sized(rule: Callable[[OpCall], Sharding], index: int, name: str) -> Callable[[OpCall], Sharding]:
    """``rule`` plus a rewrite of the size argument at ``index`` to the local output shape."""
    rewrite = _with_local_size(index, name)

    def sized(call: OpCall) -> Sharding:
        s = rule(call)
        return Sharding(s.inputs, s.outputs, rewrite)

    return sized


def _transpose_dim(call: OpCall, d: int) -> int:
    ndim = call.inputs[0].ndim
    if call.op == aten.t.default:
        a, b = 0, 1 if ndim == 2 else 0
    else:
        a, b = _norm(call.arg(1, "dim0"), ndim), _norm(call.arg(2, "dim1"), ndim)
    return b if d == a else a if d == b else d


def _permute_dim(call: OpCall, d: int) -> int:
    dims = [_norm(k, call.inputs[0].ndim) for k in call.arg(1, "dims")]
    return dims.index(d)


def _expand_dim(call: OpCall, d: int) -> int | None:
    x = call.inputs[0]
    out = call.outputs[0].shape
    e = d + len(out) - x.ndim
    return None if x.shape[d] == 1 and out[e] != 1 else e


def _unsqueeze_dim(call: OpCall, d: int) -> int:
    at = _norm(call.arg(1, "dim"), call.outputs[0].ndim)
    return d + 1 if d >= at else d


def _squeeze(x: Any, dim: Any = None) -> Any:
    """squeeze decided by the global shape, run as a ``view``: a shard of local size 1 (or 0) along a dimension
    that is longer globally stays, where a squeeze of the local tensor would drop it from this rank only."""
    shape = tuple(x.shape)
    ndim = len(shape)
    if dim is None:
        candidates = set(range(ndim))
    else:
        candidates = {_norm(k, max(ndim, 1)) for k in ([dim] if isinstance(dim, int) else dim)}
    return aten.view.default(x, [n for k, n in enumerate(shape) if not (k in candidates and n == 1)])


def _not_along(arg_index: int, name: str, default: int = 0, drops: bool = False) -> Callable[[OpCall, int], int | None]:
    """Shard survives unless it is on the op's ``dim`` argument; ``drops``: that dim disappears."""

    def map_dim(call: OpCall, d: int) -> int | None:
        along = _norm(call.arg(arg_index, name, default), call.inputs[0].ndim)
        if d == along:
            return None
        return d - 1 if drops and d > along else d

    return map_dim


def _backward_of_slice(call: OpCall, d: int) -> int | None:
    along = _norm(call.arg(2, "dim"), len(call.arg(1, "input_sizes")))
    return None if d == along else d


def _backward_of_select(call: OpCall, d: int) -> int:
    along = _norm(call.arg(2, "dim"), len(call.arg(1, "input_sizes")))
    return d + 1 if d >= along else d


def cat_rule(call: OpCall) -> Sharding:
    """cat/stack: every input takes the first input's placement unless it is along the joined dimension."""
    xs = call.inputs
    out = call.outputs[0]
    first: Placement = xs[0].placement if xs else R
    stack = call.op == aten.stack.default
    along = _norm(call.arg(1, "dim", 0), out.ndim if stack else xs[0].ndim)
    if isinstance(first, Shard):
        if not stack and first.dim == along:
            first = R
        elif any(x.ndim != xs[0].ndim for x in xs):
            first = R
    elif isinstance(first, Partial) and not all(x.placement == first for x in xs):
        first = R
    out_p: Placement = first
    if stack and isinstance(first, Shard):
        out_p = Shard(first.dim + 1 if first.dim >= along else first.dim)
    return Sharding([first] * len(xs), [out_p])


def index_add_rule(call: OpCall) -> Sharding:
    """index_add(self, dim, index, source): self and source share a shard off ``dim``; the index is replicated."""
    x, index, source = call.inputs
    along = _norm(call.arg(1, "dim"), x.ndim)
    p = x.placement
    if isinstance(p, Shard) and p.dim != along and source.ndim == x.ndim:
        return Sharding([p, R, p], [p])
    if isinstance(p, Partial) and source.placement == p:
        return Sharding([p, R, p], [p])
    return Sharding([R, R, R], [R])


#: In-place views (``x.squeeze_(0)``): the out-of-place view by its rule, then ``x`` becomes that view.
IN_PLACE_VIEWS = {
    "squeeze_": "squeeze", "unsqueeze_": "unsqueeze", "transpose_": "transpose", "t_": "t",
    "swapdims_": "swapdims", "swapaxes_": "swapaxes",
}


def _in_place_view(op: Any, method: str) -> Decompose:
    """``op`` (an in-place view such as ``unsqueeze_``) on a DTensor: the shard becomes the out-of-place view of
    itself (same memory, as torch's in-place view), and the wrapper's shape and strides follow."""
    from torch.utils._mode_utils import no_dispatch

    def in_place(x: Any, *args: Any, **kwargs: Any) -> Any:
        view = getattr(torch.Tensor, method)(x, *args, **kwargs)
        before, after = x._local_tensor, view._local_tensor
        if after.numel() and not shares_memory(after, before):
            raise InPlaceViewError(
                f"{op}: the view needs placements {list(view.placements)} where the tensor has "
                f"{list(x.placements)}, so it cannot stay in the tensor's memory; use the out-of-place op "
                f"(x = x.{method}(...)) or redistribute first"
            )
        with no_dispatch():  # the wrapper's own sizes and strides, as the op sets them on a plain tensor
            op(x, *args, **kwargs)
        x._local_tensor, x._spec = after, view._spec
        return x

    return Decompose(in_place)


def _in_place_views() -> dict[Any, Any]:
    table: dict[Any, Any] = {}
    for name, method in IN_PLACE_VIEWS.items():
        packet = getattr(aten, name)
        for overload in packet.overloads():
            op = getattr(packet, overload)
            table[op] = _in_place_view(op, method)
    return table


def rules() -> dict[Any, Any]:
    view = _sized(_dim_rule(_view_dim), 1, "size")
    return {
        aten.view.default: view,
        aten._unsafe_view.default: view,
        aten.reshape.default: view,
        aten.transpose.int: _dim_rule(_transpose_dim),
        aten.t.default: _dim_rule(_transpose_dim),
        aten.permute.default: _dim_rule(_permute_dim),
        aten.expand.default: _sized(_dim_rule(_expand_dim), 1, "size"),
        aten.unsqueeze.default: _dim_rule(_unsqueeze_dim),
        aten.squeeze.default: Decompose(_squeeze),
        aten.squeeze.dim: Decompose(_squeeze),
        aten.squeeze.dims: Decompose(_squeeze),
        aten.split.Tensor: _dim_rule(_not_along(2, "dim")),
        aten.split_with_sizes.default: _dim_rule(_not_along(2, "dim")),
        aten.unbind.int: _dim_rule(_not_along(1, "dim", drops=True)),
        aten.slice.Tensor: _dim_rule(_not_along(1, "dim")),
        aten.select.int: _dim_rule(_not_along(1, "dim", drops=True)),
        aten.index_select.default: _dim_rule(_not_along(1, "dim")),
        aten.index_add.default: index_add_rule,
        aten.slice_backward.default: _sized(_dim_rule(_backward_of_slice), 1, "input_sizes"),
        aten.select_backward.default: _sized(_dim_rule(_backward_of_select), 1, "input_sizes"),
        aten.cat.default: cat_rule,
        aten.stack.default: cat_rule,
        **_in_place_views(),
    }
