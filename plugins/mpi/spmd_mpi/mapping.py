"""torch dtypes and spmd ReduceOps to MPI datatypes and ops, for the reductions MPI does natively.

The tables need MPI's handles, so ``build_tables`` fills them when MPI is
loaded (library.py); until then ``REDUCE`` is empty.
"""

from __future__ import annotations

from typing import Any

import torch

from spmd.comm.reduce_op import ReduceOp

#: ReduceOp -> {torch.dtype: (MPI datatype, MPI op)} for every pair MPI reduces natively.
REDUCE: dict[ReduceOp, dict[torch.dtype, tuple[Any, Any]]] = {}
#: dtypes MPI has no type for: reduced in float32 staging buffers.
STAGED = frozenset({torch.float16, torch.bfloat16})


def build_tables(mpi: Any) -> None:
    """Fill ``REDUCE`` from the loaded mpi4py.MPI module (in place: importers keep the same dict)."""
    types = {
        torch.float32: mpi.FLOAT,
        torch.float64: mpi.DOUBLE,
        torch.complex64: mpi.C_FLOAT_COMPLEX,
        torch.complex128: mpi.C_DOUBLE_COMPLEX,
        torch.int8: mpi.INT8_T,
        torch.int16: mpi.INT16_T,
        torch.int32: mpi.INT32_T,
        torch.int64: mpi.INT64_T,
        torch.uint8: mpi.UINT8_T,
        torch.uint16: mpi.UINT16_T,
        torch.uint32: mpi.UINT32_T,
        torch.uint64: mpi.UINT64_T,
    }
    ops = {
        ReduceOp.SUM: mpi.SUM,
        ReduceOp.PRODUCT: mpi.PROD,
        ReduceOp.MIN: mpi.MIN,
        ReduceOp.MAX: mpi.MAX,
        ReduceOp.BAND: mpi.BAND,
        ReduceOp.BOR: mpi.BOR,
        ReduceOp.BXOR: mpi.BXOR,
    }
    # On bool, SUM/MAX/BOR mean "any", PRODUCT/MIN/BAND "all", BXOR parity (as the kernel's).
    bool_ops = {
        ReduceOp.SUM: mpi.LOR,
        ReduceOp.MAX: mpi.LOR,
        ReduceOp.BOR: mpi.LOR,
        ReduceOp.PRODUCT: mpi.LAND,
        ReduceOp.MIN: mpi.LAND,
        ReduceOp.BAND: mpi.LAND,
        ReduceOp.BXOR: mpi.LXOR,
    }
    bitwise = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)
    for op, mpi_op in ops.items():
        table: dict[torch.dtype, tuple[Any, Any]] = {}
        for dtype, mpi_type in types.items():
            if dtype.is_complex and op not in (ReduceOp.SUM, ReduceOp.PRODUCT):
                continue  # complex numbers have no order; MPI has no complex MIN/MAX
            if (dtype.is_floating_point or dtype.is_complex) and op in bitwise:
                continue
            table[dtype] = (mpi_type, mpi_op)
        table[torch.bool] = (mpi.C_BOOL, bool_ops[op])
        REDUCE[op] = table
