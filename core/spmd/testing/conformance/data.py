"""Seeded inputs and the local oracle: every rank computes every rank's input and the expected result.

Both live on the host; the checks move a rank's input to the device under test
and bring results back to compare.
"""

from __future__ import annotations

import functools
import zlib

import torch

from spmd.comm.reduce_op import ReduceOp
from spmd.comm.staging import PREDIVIDED

#: Dtypes reductions are checked on (every CPU dtype torch can do arithmetic on).
REDUCE_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool,
)
#: Dtypes data-movement ops are checked on: the above plus storage-only ones.
DATA_DTYPES = REDUCE_DTYPES + (
    torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2,
)
#: Element shapes: empty, one element, odd, 2-d, a thousand.
SHAPES = ((0,), (1,), (7,), (3, 5), (1000,))
#: Large enough (> 64 KiB for every listed dtype) to take the ring algorithms.
LARGE_SHAPE = (70001,)
LARGE_DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.bool)


def valid_ops(dtype: torch.dtype) -> tuple[ReduceOp, ...]:
    if dtype == torch.bool:
        return tuple(op for op in ReduceOp if op is not ReduceOp.AVG)
    if dtype.is_complex:
        return (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT)
    if dtype.is_floating_point:
        return (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX)
    return (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)


def _signed(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex or dtype in (torch.int8, torch.int16, torch.int32, torch.int64)


def make_input(rank: int, key: str, shape: tuple[int, ...], dtype: torch.dtype, op: ReduceOp | None = None) -> torch.Tensor:
    """Rank ``rank``'s input for case ``key``: small integers, so sums and products are exact."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{key}/{rank}".encode()))
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if op is ReduceOp.PRODUCT:
        lo, hi = (-2, 3) if _signed(dtype) else (1, 3)
    else:
        lo, hi = (-8, 9) if _signed(dtype) else (0, 9)
    values = torch.randint(lo, hi, shape, generator=gen)
    if dtype.is_complex:
        imag = torch.randint(lo, hi, shape, generator=gen)
        return torch.complex(values.double(), imag.double()).to(dtype)
    return values.to(dtype)


def strided(values: torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
    """A non-contiguous tensor on ``device`` equal to host tensor ``values`` (every other element of a wider buffer).

    Built on the host and moved whole, so it works for every dtype on every device.
    """
    if values.dim() == 0:
        return values.to(device, copy=True)
    wide = torch.zeros(*values.shape[:-1], values.shape[-1] * 2, dtype=values.dtype)
    wide[..., ::2].copy_(values)
    view = wide.to(device)[..., ::2]
    if values.numel() > 1:
        assert not view.is_contiguous()
    return view


def _wide(dtype: torch.dtype) -> torch.dtype:
    if dtype.is_complex:
        return torch.complex128
    if dtype.is_floating_point:
        return torch.float64
    return torch.int64


def expected_reduce(inputs: list[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    """The reduction of ``inputs`` computed in a wide dtype, then cast back."""
    dtype = inputs[0].dtype
    if dtype == torch.bool:
        stack = torch.stack(inputs)
        if op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.BOR):
            return stack.any(0)
        if op in (ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.BAND):
            return stack.all(0)
        return stack.long().sum(0) % 2 == 1
    stack = torch.stack([x.to(_wide(dtype)) for x in inputs])
    if op is ReduceOp.SUM:
        out = stack.sum(0)
    elif op is ReduceOp.AVG:
        out = stack.sum(0) / len(inputs)
    elif op is ReduceOp.PRODUCT:
        out = stack.prod(0)
    elif op is ReduceOp.MIN:
        out = stack.amin(0)
    elif op is ReduceOp.MAX:
        out = stack.amax(0)
    else:
        fn = {ReduceOp.BAND: torch.bitwise_and, ReduceOp.BOR: torch.bitwise_or, ReduceOp.BXOR: torch.bitwise_xor}[op]
        out = functools.reduce(fn, list(stack))
    return out.to(dtype)


def same_bytes(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Exact equality of data movement, for every dtype (float8 and uint64 included), compared on the host."""
    actual = actual.cpu()
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return False
    if actual.numel() == 0:
        return True
    return torch.equal(actual.contiguous().reshape(-1).view(torch.uint8), expected.contiguous().reshape(-1).view(torch.uint8))


def rounding_bound(inputs: list[torch.Tensor], op: ReduceOp) -> float | None:
    """How far a correct result may stray from ``expected_reduce``'s beyond torch's default tolerance:
    AVG of float16/float8 divides each input before the sum (as NCCL's ncclAvg), which rounds every
    input once more and, for a group size that is not a power of 2, moves results by a few units in
    the last place (most visibly where the mean is near 0). None: the default tolerance holds."""
    if op is not ReduceOp.AVG or inputs[0].dtype not in PREDIVIDED:
        return None
    largest = max(float(x.to(torch.float64).abs().max()) for x in inputs) if inputs[0].numel() else 0.0
    return 2 * len(inputs) * torch.finfo(inputs[0].dtype).eps * max(largest, 1.0)


def check_reduced(actual: torch.Tensor, expected: torch.Tensor, what: str, bound: float | None = None) -> None:
    """Raise AssertionError unless ``actual`` equals the oracle (exactly for integers; within ``bound``
    where ``rounding_bound`` gives one), compared on the host."""
    actual = actual.cpu()
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    if bound is not None:
        torch.testing.assert_close(actual.to(torch.float64), expected.to(torch.float64), atol=bound, rtol=0, msg=lambda m: f"{what}: {m}")
    elif actual.dtype.is_floating_point or actual.dtype.is_complex:
        torch.testing.assert_close(actual, expected, msg=lambda m: f"{what}: {m}")
    elif not torch.equal(actual, expected):
        raise AssertionError(f"{what}: got {actual.reshape(-1)[:8].tolist()}..., expected {expected.reshape(-1)[:8].tolist()}...")
