"""dtype and ReduceOp mapping: the tables match nccl.h, every pair maps or fails with a clear error."""

from __future__ import annotations

import os
import re

import pytest
import torch

pytest.importorskip("spmd_nccl", reason="spmd-nccl is not installed (pip install -e plugins/nccl)")

from spmd.comm.reduce_op import ReduceOp  # noqa: E402
from spmd.testing.conformance.data import REDUCE_DTYPES, valid_ops  # noqa: E402
from spmd_nccl import library, mapping  # noqa: E402
from spmd_nccl.mapping import UnsupportedReduction, reduction  # noqa: E402

NEW = library.version_code(2, 32, 3)
V = library.version_code


def _enum(header: str, name: str) -> dict[str, int]:
    body = re.search(r"typedef enum \{(.*?)\}\s*" + name + ";", header, re.S)
    assert body, f"no {name} in nccl.h"
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"(nccl\w+)\s*=\s*(\d+)", body.group(1))}


@pytest.fixture
def header() -> str:
    path = library.wheel_library()
    if path is None:
        pytest.skip("the nvidia-nccl-cu12 wheel (with nccl.h) is not installed")
    with open(os.path.join(os.path.dirname(os.path.dirname(path)), "include", "nccl.h")) as f:
        return f.read()


def test_dtype_codes_match_nccl_h(header: str) -> None:
    codes = _enum(header, "ncclDataType_t")
    names = {
        torch.int8: "ncclInt8", torch.uint8: "ncclUint8", torch.int32: "ncclInt32", torch.uint32: "ncclUint32",
        torch.int64: "ncclInt64", torch.uint64: "ncclUint64", torch.float16: "ncclFloat16",
        torch.float32: "ncclFloat32", torch.float64: "ncclFloat64", torch.bfloat16: "ncclBfloat16",
        torch.float8_e4m3fn: "ncclFloat8e4m3", torch.float8_e5m2: "ncclFloat8e5m2",
    }
    assert set(names) == set(mapping.DTYPES)
    for dtype, name in names.items():
        assert mapping.DTYPES[dtype][0] == codes[name], dtype
    assert mapping.BYTES == codes["ncclUint8"]


def test_op_codes_match_nccl_h(header: str) -> None:
    codes = _enum(header, "ncclRedOp_t")
    names = {ReduceOp.SUM: "ncclSum", ReduceOp.PRODUCT: "ncclProd", ReduceOp.MAX: "ncclMax", ReduceOp.MIN: "ncclMin", ReduceOp.AVG: "ncclAvg"}
    for op, name in names.items():
        assert mapping.OPS[op][0] == codes[name], op


def test_native_pairs() -> None:
    assert reduction(torch.float32, ReduceOp.SUM, NEW) == mapping.Reduction(torch.float32, mapping.ncclFloat32, mapping.ncclSum)
    assert reduction(torch.bfloat16, ReduceOp.AVG, NEW) == mapping.Reduction(torch.bfloat16, mapping.ncclBfloat16, mapping.ncclAvg)
    assert reduction(torch.uint64, ReduceOp.MIN, NEW).nccl_dtype == mapping.ncclUint64
    assert reduction(torch.float8_e4m3fn, ReduceOp.MAX, NEW).nccl_dtype == mapping.ncclFloat8e4m3


def test_bool_reduces_as_uint8_any_and_all() -> None:
    for op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.BOR):
        assert reduction(torch.bool, op, NEW) == mapping.Reduction(torch.uint8, mapping.ncclUint8, mapping.ncclMax)
    for op in (ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.BAND):
        assert reduction(torch.bool, op, NEW) == mapping.Reduction(torch.uint8, mapping.ncclUint8, mapping.ncclMin)
    with pytest.raises(UnsupportedReduction, match=r"cannot reduce bool with ReduceOp\.BXOR: NCCL cannot XOR; sum an int32 copy"):
        reduction(torch.bool, ReduceOp.BXOR, NEW)


def test_complex_sums_as_real_pairs_only() -> None:
    assert reduction(torch.complex64, ReduceOp.SUM, NEW) == mapping.Reduction(torch.float32, mapping.ncclFloat32, mapping.ncclSum)
    assert reduction(torch.complex128, ReduceOp.AVG, NEW).view_dtype == torch.float64
    with pytest.raises(UnsupportedReduction, match=r"complex64 with ReduceOp\.PRODUCT.*torch\.prod"):
        reduction(torch.complex64, ReduceOp.PRODUCT, NEW)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.int64, torch.uint8])
@pytest.mark.parametrize("op", [ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR])
def test_bitwise_on_integers_is_a_clear_error(dtype: torch.dtype, op: ReduceOp) -> None:
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(UnsupportedReduction, match=rf"cannot reduce {name} with ReduceOp\.{op.name}: NCCL has no bitwise reductions; all_gather"):
        reduction(dtype, op, NEW)


@pytest.mark.parametrize("dtype", [torch.int16, torch.uint16])
def test_16_bit_integers_are_a_clear_error(dtype: torch.dtype) -> None:
    with pytest.raises(UnsupportedReduction, match=r"no 16-bit integer type; reduce an int32 copy .*cpu:gloo,cuda:nccl"):
        reduction(dtype, ReduceOp.SUM, NEW)


def test_float8_needs_nccl_2_24_and_the_fn_variants() -> None:
    with pytest.raises(UnsupportedReduction, match=r"NCCL 2\.23\.4 lacks float8_e5m2 \(added in NCCL 2\.24\.0\)"):
        reduction(torch.float8_e5m2, ReduceOp.SUM, V(2, 23, 4))
    assert reduction(torch.float8_e5m2, ReduceOp.SUM, V(2, 24, 3)).nccl_dtype == mapping.ncclFloat8e5m2
    with pytest.raises(UnsupportedReduction, match="only 8-bit floats are float8_e4m3fn and float8_e5m2"):
        reduction(torch.float8_e4m3fnuz, ReduceOp.SUM, NEW)


def test_avg_needs_a_floating_dtype() -> None:
    with pytest.raises(UnsupportedReduction, match="integer mean would round"):
        reduction(torch.int32, ReduceOp.AVG, NEW)
    with pytest.raises(UnsupportedReduction, match="integer mean would round"):
        reduction(torch.bool, ReduceOp.AVG, NEW)


def test_unsupported_reduction_is_a_type_error() -> None:
    assert issubclass(UnsupportedReduction, TypeError)


def test_every_conformance_pair_maps_or_fails_clearly() -> None:
    """Over the conformance suite's reduce dtypes and ops: exactly these pairs are not NCCL's."""
    unsupported = set()
    for dtype in REDUCE_DTYPES:
        for op in valid_ops(dtype):
            try:
                plan = reduction(dtype, op, NEW)
            except UnsupportedReduction as error:
                text = str(error)
                assert str(dtype).removeprefix("torch.") in text and f"ReduceOp.{op.name}" in text
                assert "; " in text  # the second half says what to do instead
                unsupported.add((dtype, op))
                continue
            assert plan.view_dtype in mapping.DTYPES
    bitwise = {ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR}
    expected = {(d, op) for d in (torch.int8, torch.uint8, torch.int32, torch.int64) for op in bitwise}
    expected |= {(torch.int16, op) for op in valid_ops(torch.int16)}
    expected |= {(torch.complex64, ReduceOp.PRODUCT), (torch.complex128, ReduceOp.PRODUCT), (torch.bool, ReduceOp.BXOR)}
    assert unsupported == expected


def test_supported_pairs_grow_with_the_version() -> None:
    old = set(mapping.supported_pairs(V(2, 14, 0)))
    new = set(mapping.supported_pairs(NEW))
    assert old < new
    assert new - old == {(d, op) for d in (torch.float8_e4m3fn, torch.float8_e5m2) for op in mapping.OPS}
