"""The sharding-rule contract: what a rule receives, what it returns, and the ready-made rules.

A rule decides, for one aten op and one mesh dimension at a time, which
placement each DTensor input must have and which placement each output gets::

    def my_rule(call: spmd.tensor.OpCall) -> spmd.tensor.Sharding:
        x, = call.inputs                       # TensorArg: shape, dtype, placement (on this mesh dim)
        if x.placement.is_shard(x.ndim - 1):   # cannot compute on a split last dimension
            return Sharding([Replicate()], [Replicate()])
        return Sharding([x.placement], [x.placement])

spmd calls the rule once per mesh dimension; placements on the other mesh
dimensions are decided independently. It redistributes each input to the
placement the rule asked for (a no-op when unchanged), runs the op on the
local shards, and wraps each output with the rule's placement. Global output
shapes come from running the op on meta tensors, so a rule never computes
shapes. Results are cached per (op, input placements, shapes, dtypes,
non-tensor arguments): a training loop pays for a rule once per signature.

A rule may instead be a ``Decompose(fn)``: ``fn(*args, **kwargs)`` is called
with the DTensors themselves and returns the result, built from other
DTensor ops (or from local shards and ``spmd.tensor.comm`` collectives).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from spmd.tensor.placements import Partial, Placement, Replicate, Shard

REPLICATE = Replicate()


@dataclass(frozen=True)
class TensorArg:
    """A DTensor argument as a rule sees it: global shape, dtype, placement on the mesh dim being decided."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    placement: Placement
    #: Placements on every mesh dimension (for rules that must know about nested sharding).
    placements: tuple[Placement, ...] = ()

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass(frozen=True)
class TensorMeta:
    """An output's global shape and dtype (from the op run on meta tensors)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass
class OpCall:
    """One call of an op, as a rule sees it for one mesh dimension."""

    op: torch._ops.OpOverload
    #: The op's positional arguments with every DTensor replaced by its TensorArg (lists kept as lists).
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    #: Every DTensor argument, in the order they appear in args then kwargs (lists flattened).
    inputs: tuple[TensorArg, ...]
    #: The op's tensor outputs (flattened), global.
    outputs: tuple[TensorMeta, ...]
    mesh_dim: int
    mesh_dim_size: int

    def arg(self, index: int, name: str, default: Any = None) -> Any:
        """Positional argument ``index``, or keyword ``name``, or ``default``."""
        if index < len(self.args):
            return self.args[index]
        return self.kwargs.get(name, default)


@dataclass(frozen=True)
class LocalInfo:
    """What a ``rewrite`` needs to turn the global arguments into this rank's local ones."""

    #: Local shapes of the outputs on this rank.
    out_shapes: tuple[tuple[int, ...], ...]
    #: Local shapes of the (redistributed) DTensor inputs on this rank.
    in_shapes: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Sharding:
    """A rule's answer for one mesh dimension: the placement each input needs, and each output's placement.

    ``rewrite(args, kwargs, info) -> (args, kwargs)`` adapts size-like
    arguments to the local shards (``view``'s size, for example).
    """

    inputs: Sequence[Placement]
    outputs: Sequence[Placement]
    rewrite: Callable[[tuple, dict, LocalInfo], tuple[tuple, dict]] | None = field(default=None, compare=False)


Rule = Callable[[OpCall], Sharding]


@dataclass(frozen=True)
class Decompose:
    """A rule that computes the op itself from the DTensor arguments (``fn(*args, **kwargs)``)."""

    fn: Callable[..., Any]


# -- ready-made rules -----------------------------------------------------------------------------


def aligned_dim(arg: TensorArg, out_ndim: int, out_shape: tuple[int, ...], dim: int) -> int | None:
    """The dimension of ``arg`` that broadcasts to output dimension ``dim``, or None if it is broadcast."""
    offset = out_ndim - arg.ndim
    d = dim - offset
    if d < 0 or d >= arg.ndim or (arg.shape[d] == 1 and out_shape[dim] != 1):
        return None
    return d


def _elementwise(call: OpCall, linear: bool) -> Sharding:
    out = call.outputs[0] if call.outputs else None
    inputs = call.inputs
    n_out = len(call.outputs)
    if out is None:
        return Sharding([REPLICATE] * len(inputs), [])
    if any(a.ndim > out.ndim for a in inputs):  # not a broadcasting elementwise call: compute on whole tensors
        return Sharding([REPLICATE] * len(inputs), [REPLICATE] * n_out)
    in_place = call.op._schema.is_mutable and bool(inputs)
    driver_order = [inputs[0]] if in_place else list(inputs)
    # 1. a shard on a dimension that maps onto the output wins
    for arg in driver_order:
        p = arg.placement
        if isinstance(p, Shard):
            out_dim = p.dim + (out.ndim - arg.ndim)
            if aligned_dim(arg, out.ndim, out.shape, out_dim) is not None:
                wanted: list[Placement] = []
                for other in inputs:
                    d = aligned_dim(other, out.ndim, out.shape, out_dim)
                    wanted.append(Shard(d) if d is not None else REPLICATE)
                return Sharding(wanted, [Shard(out_dim)] * n_out)
    # 2. partial sums pass through linear ops (in place only onto a partial ``self``: an op never turns
    #    the tensor it writes partial, or an optimizer step would leave a replicated parameter partial)
    partials = [a.placement for a in inputs if isinstance(a.placement, Partial)]
    if in_place and not isinstance(inputs[0].placement, Partial):
        partials = []
    if linear and partials and partials[0].reduce_op == "sum":
        name = call.op.__name__.split(".")[0].rstrip("_")
        if name in _ADDITIVE:  # a replicated operand becomes a partial one locally (rank 0 keeps it)
            if len(inputs) >= 2:  # a scalar operand would be added once per rank
                return Sharding([partials[0]] * len(inputs), [partials[0]] * n_out)
            return Sharding([REPLICATE] * len(inputs), [REPLICATE] * n_out)
        first = next(i for i, a in enumerate(inputs) if isinstance(a.placement, Partial))
        # scaling: one operand partial, the rest replicated (a quotient only in its numerator: the call's first
        # argument, which a plain 0-dim tensor, not among the DTensor inputs, may also be)
        if name not in _NUMERATOR_ONLY or (call.args and call.args[0] is inputs[first]):
            scaled: list[Placement] = [partials[0] if i == first else REPLICATE for i in range(len(inputs))]
            return Sharding(scaled, [partials[0]] * n_out)
    return Sharding([REPLICATE] * len(inputs), [REPLICATE] * n_out)


_ADDITIVE = {"add", "sub"}
_NUMERATOR_ONLY = {"div"}


def pointwise_rule(call: OpCall) -> Sharding:
    """For elementwise ops (with broadcasting): keep a shard, otherwise replicate; a partial sum is resolved first.

    A plugin maps its own elementwise op to it: ``{torch.ops.mylib.gelu2.default: spmd.tensor.pointwise_rule}``.
    """
    return _elementwise(call, linear=False)


def linear_pointwise_rule(call: OpCall) -> Sharding:
    """For elementwise ops linear in their DTensor inputs (add, sub, neg, scaling): partial sums pass through."""
    return _elementwise(call, linear=True)


def replicate_rule(call: OpCall) -> Sharding:
    """Every input and output replicated: correct for any op, with the communication that costs."""
    return Sharding([REPLICATE] * len(call.inputs), [REPLICATE] * len(call.outputs))
