"""ReduceOp and the local reduction kernels that the generic algorithms apply."""

from __future__ import annotations

import enum
from collections.abc import Callable

import torch


class ReduceOp(enum.Enum):
    """How a reduction combines the ranks' tensors (torch.distributed's names)."""

    SUM = "sum"
    AVG = "avg"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"

    #: Members are singletons compared by identity, so hash by identity too: Enum's own
    #: ``__hash__`` is Python code, and the collectives look ops up in dicts on every call.
    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"ReduceOp.{self.name}"


_BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)


def is_floating(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


#: dtypes already checked per op (``route`` reads it inline: the common case costs no call).
checked_dtypes: dict[ReduceOp, set[torch.dtype]] = {}


def check_reduce_op(op: ReduceOp, dtype: torch.dtype) -> None:
    """Raise a clear TypeError when ``op`` makes no sense for ``dtype``."""
    checked = checked_dtypes.get(op)
    if checked is not None and dtype in checked:
        return
    _check(op, dtype)
    checked_dtypes.setdefault(op, set()).add(dtype)


def _check(op: ReduceOp, dtype: torch.dtype) -> None:
    if not isinstance(op, ReduceOp):
        raise TypeError(f"op must be a spmd.ReduceOp, got {op!r}; use e.g. spmd.ReduceOp.SUM")
    if op in _BITWISE and is_floating(dtype):
        raise TypeError(
            f"{op!r} is a bitwise reduction and cannot apply to a {dtype} tensor; "
            "use an integer or bool tensor, or SUM/MIN/MAX for floating point"
        )
    if op in (ReduceOp.MIN, ReduceOp.MAX) and dtype.is_complex:
        raise TypeError(f"{op!r} is undefined for complex dtype {dtype}: complex numbers have no order")
    if op is ReduceOp.AVG and not is_floating(dtype):
        raise TypeError(
            f"ReduceOp.AVG needs a floating-point tensor, got {dtype}: an integer mean would "
            "round silently. Reduce with SUM and divide, or cast to a floating dtype first"
        )


def _any(acc: torch.Tensor, x: torch.Tensor) -> None:
    torch.logical_or(acc, x, out=acc)


def _all(acc: torch.Tensor, x: torch.Tensor) -> None:
    torch.logical_and(acc, x, out=acc)


def _xor(acc: torch.Tensor, x: torch.Tensor) -> None:
    torch.logical_xor(acc, x, out=acc)


# On bool, SUM/MAX/BOR mean "any", PRODUCT/MIN/BAND mean "all", BXOR is parity.
_BOOL_KERNELS: dict[ReduceOp, Callable[[torch.Tensor, torch.Tensor], None]] = {
    ReduceOp.SUM: _any,
    ReduceOp.MAX: _any,
    ReduceOp.BOR: _any,
    ReduceOp.PRODUCT: _all,
    ReduceOp.MIN: _all,
    ReduceOp.BAND: _all,
    ReduceOp.BXOR: _xor,
}


#: The in-place methods themselves where there is one (no wrapper frame: a small reduction's hot path).
_KERNELS: dict[ReduceOp, Callable[[torch.Tensor, torch.Tensor], object]] = {
    ReduceOp.SUM: torch.Tensor.add_,
    ReduceOp.AVG: torch.Tensor.add_,  # divided once at the end
    ReduceOp.PRODUCT: torch.Tensor.mul_,
    ReduceOp.MIN: lambda acc, x: torch.minimum(acc, x, out=acc),
    ReduceOp.MAX: lambda acc, x: torch.maximum(acc, x, out=acc),
    ReduceOp.BAND: torch.Tensor.bitwise_and_,
    ReduceOp.BOR: torch.Tensor.bitwise_or_,
    ReduceOp.BXOR: torch.Tensor.bitwise_xor_,
}


#: dtypes torch has no CPU arithmetic for (add, min, max...), reduced in a wider dtype and cast back.
#: Exact: the wide result of two values cast back is what the narrow kernel would give (unsigned
#: integers wrap alike; a float32 sum of two float8 values is exact, so it is rounded once).
_WIDENED: dict[torch.dtype, torch.dtype] = {
    torch.uint16: torch.int64,
    torch.uint32: torch.int64,
    **{getattr(torch, name): torch.float32 for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
       if hasattr(torch, name)},
}
_INT64_SIGN = torch.iinfo(torch.int64).min


def reduce_into(acc: torch.Tensor, other: torch.Tensor, op: ReduceOp) -> None:
    """``acc = op(acc, other)`` in place (AVG accumulates a sum); no allocation but for the dtypes
    torch cannot compute on directly (``_WIDENED``, uint64)."""
    dtype = acc.dtype
    if dtype == torch.bool:
        _BOOL_KERNELS[op](acc, other)
    elif dtype in _WIDENED:
        wide = acc.to(_WIDENED[dtype])
        _KERNELS[op](wide, other.to(wide.dtype))
        acc.copy_(wide)
    elif dtype == torch.uint64:
        _reduce_uint64(acc, other, op)
    else:
        _KERNELS[op](acc, other)


def _reduce_uint64(acc: torch.Tensor, other: torch.Tensor, op: ReduceOp) -> None:
    """uint64 as int64 bits: sums, products and bitwise ops are the same bits in two's complement;
    MIN and MAX compare with the sign bit flipped (unsigned order)."""
    a, b = acc.view(torch.int64), other.view(torch.int64)
    if op in (ReduceOp.MIN, ReduceOp.MAX):
        flipped = a ^ _INT64_SIGN
        _KERNELS[op](flipped, b ^ _INT64_SIGN)
        torch.bitwise_xor(flipped, _INT64_SIGN, out=a)
    else:
        _KERNELS[op](a, b)


def divide(tensor: torch.Tensor, count: int) -> None:
    """``tensor /= count`` in place, for every floating dtype (float8 through float32)."""
    if tensor.dtype in _WIDENED:
        tensor.copy_(tensor.to(_WIDENED[tensor.dtype]).div_(count))
    else:
        tensor.div_(count)


def finish_avg(tensor: torch.Tensor, op: ReduceOp, count: int) -> None:
    """Turn the sum that AVG accumulated into the mean over ``count`` ranks."""
    if op is ReduceOp.AVG and count > 1:
        divide(tensor, count)
