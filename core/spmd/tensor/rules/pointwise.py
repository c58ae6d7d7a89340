"""Elementwise ops: every overload of each listed op, in-place ones included, with broadcasting."""

from __future__ import annotations

from typing import Any

import torch

from spmd.tensor.rule import OpCall, Sharding, linear_pointwise_rule, pointwise_rule

aten = torch.ops.aten

#: Linear in their DTensor operands: partial sums pass through.
LINEAR = [
    "add", "sub", "neg", "mul", "div", "clone", "_to_copy", "detach", "alias", "positive",
    "lift_fresh", "contiguous", "real",
]

#: Everything else elementwise: a partial sum is resolved first.
NONLINEAR = [
    "abs", "acos", "acosh", "asin", "asinh", "atan", "atan2", "atanh", "bitwise_and", "bitwise_not",
    "bitwise_or", "bitwise_xor", "ceil", "clamp", "clamp_min", "clamp_max", "cos", "cosh", "eq", "erf",
    "erfc", "erfinv", "exp", "exp2", "expm1", "floor", "floor_divide", "fmod", "frac", "ge", "gelu",
    "gelu_backward", "gt", "hardsigmoid", "hardswish", "hardtanh", "hardtanh_backward", "isinf", "isnan",
    "le", "leaky_relu", "leaky_relu_backward", "lerp", "log", "log10", "log1p", "log2", "logical_and",
    "logical_not", "logical_or", "logical_xor", "logit", "lt", "masked_fill", "maximum", "minimum", "mish",
    "nan_to_num", "ne", "pow", "reciprocal", "relu", "remainder", "round", "rsqrt", "rsub", "sigmoid",
    "sigmoid_backward", "sign", "silu", "silu_backward", "sin", "sinh", "softplus", "softplus_backward",
    "sqrt", "square", "tan", "tanh", "tanh_backward", "threshold", "threshold_backward", "trunc", "where",
    "addcmul", "addcdiv", "elu", "elu_backward", "native_dropout_backward", "isfinite", "signbit",
    "copysign", "xlogy", "bitwise_left_shift", "bitwise_right_shift", "fill", "mish_backward",
    "hardswish_backward", "hardsigmoid_backward", "sgn", "log_sigmoid_forward", "log_sigmoid_backward",
]


def _overloads(name: str) -> list[Any]:
    found = []
    for variant in (name, name + "_"):
        packet = getattr(aten, variant, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            if "out" in overload:  # out= variants write into a given tensor: not supported on DTensor
                continue
            found.append(op)
    return found


def cast_rule(call: OpCall) -> Sharding:
    """``_to_copy``: linear into a floating or complex dtype; rounding into an integer or bool is not, so a
    partial sum is resolved first (the sum of truncated summands is not the truncated sum)."""
    dtype = call.outputs[0].dtype if call.outputs else None
    if dtype is not None and (dtype.is_floating_point or dtype.is_complex):
        return linear_pointwise_rule(call)
    return pointwise_rule(call)


def rules() -> dict[Any, Any]:
    table: dict[Any, Any] = {}
    for name in LINEAR:
        for op in _overloads(name):
            # div's rounding modes (floor, trunc) are not linear
            table[op] = pointwise_rule if op._overloadname.endswith("mode") else linear_pointwise_rule
    for op in _overloads("_to_copy"):
        table[op] = cast_rule
    for name in NONLINEAR:
        for op in _overloads(name):
            table[op] = pointwise_rule
    return table
