"""Checkpoint metadata: the global layout of every tensor and the non-tensor values, as JSON.

Pure data. ``metadata.json`` at the checkpoint's root is written last, in one
atomic replace: it names the data directory of the save it commits, so a
checkpoint is whatever its ``metadata.json`` says, and a save that never got
that far leaves the previous one untouched.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from spmd.checkpoint.errors import CheckpointError
from spmd.checkpoint.errors import CheckpointFileMissing as CheckpointFileMissing

FORMAT = "spmd-checkpoint"
VERSION = 1
METADATA_FILE = "metadata.json"
DATA_PREFIX = "data-"
#: A save's data directory: DATA_PREFIX and 12 hex digits. Only such names are ever removed or called
#: partial, so a user's own ``data-splits/`` beside a checkpoint is left alone.
DATA_DIR = re.compile(r"data-[0-9a-f]{12}")

#: torch dtype <-> safetensors dtype name.
DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
TORCH_DTYPES = {name: dtype for dtype, name in DTYPES.items()}


def is_data_dir(name: str) -> bool:
    """Whether ``name`` (a top-level entry of a checkpoint) is a save's data directory."""
    return DATA_DIR.fullmatch(name) is not None


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of ``dtype``, or an error naming the dtypes that can be stored."""
    try:
        return DTYPES[dtype]
    except KeyError:
        raise CheckpointError(
            f"dtype {dtype} cannot be stored in safetensors; convert it (e.g. complex -> torch.view_as_real) "
            f"or use one of {sorted(str(d) for d in DTYPES)}"
        ) from None


@dataclass(frozen=True)
class Chunk:
    """One stored box of a tensor: its offsets and sizes in the global tensor and where its bytes are."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str  # relative to the checkpoint root
    name: str  # the tensor's name inside the safetensors file
    begin: int  # absolute byte offset of the first element in the file
    end: int


@dataclass
class TensorEntry:
    """A stored tensor: global shape, dtype, the placements it was saved with, its chunks."""

    shape: tuple[int, ...]
    dtype: str
    placements: str = ""
    chunks: list[Chunk] = field(default_factory=list)

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        return sum(c.end - c.begin for c in self.chunks)


@dataclass
class Metadata:
    """Everything ``load`` needs to find every byte, without opening a data file first."""

    data_dir: str
    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    world_size: int = 1
    version: int = VERSION

    def to_json(self) -> bytes:
        """The JSON document (``metadata.json``)."""
        doc = {
            "format": FORMAT,
            "version": self.version,
            "data_dir": self.data_dir,
            "world_size": self.world_size,
            "tensors": {
                key: {
                    "shape": list(e.shape),
                    "dtype": e.dtype,
                    "placements": e.placements,
                    "chunks": [
                        {"offsets": list(c.offsets), "sizes": list(c.sizes), "file": c.file, "name": c.name,
                         "begin": c.begin, "end": c.end}
                        for c in e.chunks
                    ],
                }
                for key, e in self.tensors.items()
            },
            "values": self.values,
        }
        return json.dumps(doc, indent=1).encode()
