"""torch dtypes and spmd ReduceOps in NCCL's terms, per NCCL version.

Data movement (broadcast, all-gather, all-to-all, gather, scatter, send/recv)
moves raw bytes, so every dtype works on every NCCL. Reductions need NCCL to
know the type and the operation; ``reduction(dtype, op, version)`` returns how
to run one, or raises ``UnsupportedReduction`` (a TypeError) that names the
pair and what to do instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spmd.comm.reduce_op import ReduceOp
from spmd_nccl.library import decode_version, version_code

# ncclDataType_t
ncclInt8 = 0
ncclUint8 = 1
ncclInt32 = 2
ncclUint32 = 3
ncclInt64 = 4
ncclUint64 = 5
ncclFloat16 = 6
ncclFloat32 = 7
ncclFloat64 = 8
ncclBfloat16 = 9
ncclFloat8e4m3 = 10
ncclFloat8e5m2 = 11

# ncclRedOp_t
ncclSum = 0
ncclProd = 1
ncclMax = 2
ncclMin = 3
ncclAvg = 4

#: Data movement sends the tensor's bytes as ncclUint8: every dtype, no conversion.
BYTES = ncclUint8

#: torch dtype -> (ncclDataType_t, first NCCL version that has it; 0 = every supported version).
DTYPES: dict[torch.dtype, tuple[int, int]] = {
    torch.int8: (ncclInt8, 0),
    torch.uint8: (ncclUint8, 0),
    torch.int32: (ncclInt32, 0),
    torch.uint32: (ncclUint32, 0),
    torch.int64: (ncclInt64, 0),
    torch.uint64: (ncclUint64, 0),
    torch.float16: (ncclFloat16, 0),
    torch.float32: (ncclFloat32, 0),
    torch.float64: (ncclFloat64, 0),
    torch.bfloat16: (ncclBfloat16, version_code(2, 10, 0)),
    torch.float8_e4m3fn: (ncclFloat8e4m3, version_code(2, 24, 0)),
    torch.float8_e5m2: (ncclFloat8e5m2, version_code(2, 24, 0)),
}

#: spmd ReduceOp -> (ncclRedOp_t, first NCCL version that has it). BAND/BOR/BXOR have none.
OPS: dict[ReduceOp, tuple[int, int]] = {
    ReduceOp.SUM: (ncclSum, 0),
    ReduceOp.PRODUCT: (ncclProd, 0),
    ReduceOp.MAX: (ncclMax, 0),
    ReduceOp.MIN: (ncclMin, 0),
    ReduceOp.AVG: (ncclAvg, version_code(2, 10, 0)),
}

#: Complex tensors reduce as (real, imag) pairs of this dtype, for SUM and AVG only.
COMPLEX_AS_REAL = {
    torch.complex32: torch.float16,
    torch.complex64: torch.float32,
    torch.complex128: torch.float64,
}

#: bool reduces as uint8 0/1: "any" is MAX, "all" is MIN (XOR has no NCCL equivalent).
BOOL_OPS = {
    ReduceOp.SUM: ReduceOp.MAX,
    ReduceOp.MAX: ReduceOp.MAX,
    ReduceOp.BOR: ReduceOp.MAX,
    ReduceOp.PRODUCT: ReduceOp.MIN,
    ReduceOp.MIN: ReduceOp.MIN,
    ReduceOp.BAND: ReduceOp.MIN,
}

_CPU_ROUTE = "or reduce it on a CPU backend (spmd.init('cpu:gloo,cuda:nccl') and a CPU copy of the tensor)"


class UnsupportedReduction(TypeError):
    """A (dtype, ReduceOp) pair NCCL cannot reduce; the message says what to use instead."""


@dataclass(frozen=True)
class Reduction:
    """How to run one reduction on NCCL: view the tensor as ``view_dtype``, reduce with these codes."""

    view_dtype: torch.dtype
    nccl_dtype: int
    nccl_op: int


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _version(code: int) -> str:
    return ".".join(map(str, decode_version(code)))


def _fail(dtype: torch.dtype, op: ReduceOp, why: str, instead: str) -> UnsupportedReduction:
    return UnsupportedReduction(f"NCCL cannot reduce {_name(dtype)} with ReduceOp.{op.name}: {why}; {instead}")


def reduction(dtype: torch.dtype, op: ReduceOp, version: int) -> Reduction:
    """How NCCL ``version`` reduces ``dtype`` with ``op``, or UnsupportedReduction saying why not."""
    if op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR) and dtype is not torch.bool:
        raise _fail(
            dtype, op, "NCCL has no bitwise reductions",
            "all_gather the tensors and combine them locally (functools.reduce(torch.bitwise_or, tensors)), " + _CPU_ROUTE,
        )
    if op is ReduceOp.AVG and not (dtype.is_floating_point or dtype.is_complex):
        raise _fail(dtype, op, "an integer mean would round", "reduce with SUM and divide, or cast to a floating dtype first")
    view = dtype
    if dtype is torch.bool:
        if op not in BOOL_OPS:
            raise _fail(
                dtype, op, "NCCL cannot XOR",
                "sum an int32 copy and keep the parity (c = t.int(); spmd.all_reduce(c); t.copy_(c % 2 == 1)), " + _CPU_ROUTE,
            )
        view, op = torch.uint8, BOOL_OPS[op]
    elif dtype in COMPLEX_AS_REAL:
        if op not in (ReduceOp.SUM, ReduceOp.AVG):
            raise _fail(
                dtype, op, "NCCL reduces complex numbers only as (real, imag) pairs, which is right for SUM and AVG alone",
                "all_gather the tensors and take torch.prod(torch.stack(tensors), 0) locally, " + _CPU_ROUTE,
            )
        view = COMPLEX_AS_REAL[dtype]
    native = DTYPES.get(view)
    if native is None:
        if dtype in (torch.int16, torch.uint16):
            instead = "reduce an int32 copy (c = t.int(); spmd.all_reduce(c, op); t.copy_(c)), " + _CPU_ROUTE
            why = "NCCL has no 16-bit integer type"
        elif dtype.is_floating_point and dtype.itemsize == 1:
            instead = "reduce a bfloat16 or float32 copy, " + _CPU_ROUTE
            why = "NCCL's only 8-bit floats are float8_e4m3fn and float8_e5m2"
        else:
            instead = "cast to a dtype NCCL has (" + ", ".join(_name(d) for d in DTYPES) + "), " + _CPU_ROUTE
            why = "NCCL has no such type"
        raise _fail(dtype, op, why, instead)
    nccl_dtype, dtype_since = native
    if version < dtype_since:
        raise _fail(
            dtype, op, f"NCCL {_version(version)} lacks {_name(view)} (added in NCCL {_version(dtype_since)})",
            "pip install -U nvidia-nccl-cu12, or reduce a float32 copy",
        )
    nccl_op, op_since = OPS[op]
    if version < op_since:
        raise _fail(
            dtype, op, f"NCCL {_version(version)} lacks ReduceOp.{op.name} (added in NCCL {_version(op_since)})",
            "pip install -U nvidia-nccl-cu12",
        )
    return Reduction(view, nccl_dtype, nccl_op)


def supported_pairs(version: int) -> list[tuple[torch.dtype, ReduceOp]]:
    """Every (dtype, op) pair NCCL ``version`` reduces (for documentation and tests)."""
    dtypes = list(DTYPES) + [torch.bool, *COMPLEX_AS_REAL]
    pairs = []
    for dtype in dtypes:
        for op in ReduceOp:
            try:
                reduction(dtype, op, version)
            except UnsupportedReduction:
                continue
            pairs.append((dtype, op))
    return pairs
