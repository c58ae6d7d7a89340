"""Validating ``metadata.json`` before anything trusts it: types, dtypes, shapes, byte ranges, file names, tiling.

A checkpoint directory is untrusted input. Every field ``load`` and the
tools use is checked here, so a damaged or hostile file ends in one
``CheckpointError`` naming the file and the field, not a KeyError, a read
outside the directory, or silently wrong values.
"""

from __future__ import annotations

import math
import re
from typing import Any

from spmd.checkpoint.metadata import (
    FORMAT,
    TORCH_DTYPES,
    VERSION,
    CheckpointError,
    Chunk,
    Metadata,
    TensorEntry,
    is_data_dir,
)
from spmd.checkpoint.tiling import tiling_problem
from spmd.checkpoint.untrusted import show, strict_loads

#: The largest ``metadata.json`` read (a million-chunk checkpoint's is a few hundred MB less than this).
MAX_METADATA_BYTES = 256 * 2**20
#: The most dimensions a stored tensor may have, and the largest size or offset along one.
MAX_NDIM = 64
MAX_EXTENT = 2**62
#: The data files spmd writes in a save's data directory.
RANK_FILE = re.compile(r"rank-[0-9]{5,}\.safetensors")


def _damaged(where: str, field: str, problem: str) -> CheckpointError:
    return CheckpointError(f"{where}: {field} {problem}; the checkpoint is damaged or was not written by spmd")


def _int(value: Any, where: str, field: str, low: int = 0, high: int = MAX_EXTENT) -> int:
    if type(value) is not int or not low <= value <= high:
        raise _damaged(where, field, f"is {show(value)}, not an integer in [{low}, {high}]")
    return value


def _str(value: Any, where: str, field: str) -> str:
    if not isinstance(value, str):
        raise _damaged(where, field, f"is {show(value)}, not a string")
    return value


def _dims(value: Any, where: str, field: str, ndim: int | None) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > MAX_NDIM or (ndim is not None and len(value) != ndim):
        want = f"{ndim} integers" if ndim is not None else f"a list of at most {MAX_NDIM} integers"
        raise _damaged(where, field, f"is {show(value)}, not {want}")
    return tuple(_int(v, where, f"{field}[{i}]") for i, v in enumerate(value))


def _object(value: Any, where: str, field: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _damaged(where, field, f"is {show(value)}, not an object")
    return value


def _field(doc: dict[str, Any], name: str, where: str, prefix: str) -> Any:
    if name not in doc:
        raise _damaged(where, f"{prefix}{name}", "is missing")
    return doc[name]


def _chunk(doc: Any, where: str, field: str, entry: TensorEntry, data_dir: str, itemsize: int) -> Chunk:
    doc = _object(doc, where, field)
    ndim = len(entry.shape)
    offsets = _dims(_field(doc, "offsets", where, f"{field}."), where, f"{field}.offsets", ndim)
    sizes = _dims(_field(doc, "sizes", where, f"{field}."), where, f"{field}.sizes", ndim)
    for d, (o, s, n) in enumerate(zip(offsets, sizes, entry.shape)):
        if o + s > n:
            raise _damaged(where, f"{field}", f"reaches element {o + s} of dimension {d}, which has {n}")
    file = _str(_field(doc, "file", where, f"{field}."), where, f"{field}.file")
    directory, _, name = file.partition("/")
    if directory != data_dir or not RANK_FILE.fullmatch(name):
        raise CheckpointError(
            f"{where}: {field}.file is {show(file)}, not {data_dir}/rank-NNNNN.safetensors (a file of this "
            "save's data directory); refusing a path that could point outside the checkpoint"
        )
    begin = _int(_field(doc, "begin", where, f"{field}."), where, f"{field}.begin")
    end = _int(_field(doc, "end", where, f"{field}."), where, f"{field}.end")
    if end - begin != math.prod(sizes) * itemsize:
        raise _damaged(where, f"{field}.begin/end", f"span {end - begin} bytes, but {list(sizes)} {entry.dtype} needs "
                                                    f"{math.prod(sizes) * itemsize}")
    chunk_name = _str(_field(doc, "name", where, f"{field}."), where, f"{field}.name")
    return Chunk(offsets, sizes, file, chunk_name, begin, end)


def _entry(key: str, doc: Any, where: str, data_dir: str) -> TensorEntry:
    field = f"tensors[{show(key)}]"
    doc = _object(doc, where, field)
    shape = _dims(_field(doc, "shape", where, f"{field}."), where, f"{field}.shape", None)
    dtype = _str(_field(doc, "dtype", where, f"{field}."), where, f"{field}.dtype")
    if dtype not in TORCH_DTYPES:
        raise _damaged(where, f"{field}.dtype", f"is {show(dtype)}, not one of {sorted(TORCH_DTYPES)}")
    placements = _str(doc.get("placements", ""), where, f"{field}.placements")
    entry = TensorEntry(shape, dtype, placements)
    chunks = _field(doc, "chunks", where, f"{field}.")
    if not isinstance(chunks, list):
        raise _damaged(where, f"{field}.chunks", f"is {show(chunks)}, not a list")
    itemsize = TORCH_DTYPES[dtype].itemsize
    entry.chunks = [_chunk(c, where, f"{field}.chunks[{i}]", entry, data_dir, itemsize) for i, c in enumerate(chunks)]
    problem = tiling_problem(shape, [(c.offsets, c.sizes) for c in entry.chunks])
    if problem is not None:
        raise _damaged(where, f"{field}.chunks", f"do not tile its shape {list(shape)}: {problem}")
    return entry


def parse_metadata(data: bytes | bytearray | memoryview, where: str = "metadata.json") -> Metadata:
    """A validated ``Metadata`` from the bytes of ``metadata.json``, or a CheckpointError naming the field."""
    if len(data) > MAX_METADATA_BYTES:
        raise CheckpointError(f"{where} is {len(data)} bytes, more than the {MAX_METADATA_BYTES} a checkpoint's "
                              "metadata may have; it is damaged or not an spmd checkpoint")
    doc = strict_loads(data, where)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CheckpointError(f"{where} is not an spmd checkpoint's metadata (no \"format\": \"{FORMAT}\")")
    version = _int(_field(doc, "version", where, ""), where, "version", low=1, high=2**31)
    if version > VERSION:
        raise CheckpointError(f"{where} has format version {version}; this spmd reads up to {VERSION}")
    data_dir = _str(_field(doc, "data_dir", where, ""), where, "data_dir")
    if not is_data_dir(data_dir):
        raise CheckpointError(f"{where}: data_dir is {show(data_dir)}, not data-<12 hex digits>; refusing a path "
                              "that could point outside the checkpoint")
    world_size = _int(doc.get("world_size", 1), where, "world_size", low=1, high=2**31)
    tensors = _object(_field(doc, "tensors", where, ""), where, "tensors")
    values = _object(_field(doc, "values", where, ""), where, "values")
    entries = {key: _entry(key, e, where, data_dir) for key, e in tensors.items()}
    both = set(entries) & set(values)
    if both:
        raise _damaged(where, "tensors and values", f"both hold {show(sorted(both))}")
    return Metadata(data_dir, entries, values, world_size, version)
