"""Writing safetensors files straight from tensor memory (no concatenated copy), and reading byte ranges.

The format: an 8-byte little-endian header length, a JSON header
(name -> dtype, shape, data_offsets relative to the data section), then the
data. Files written here open with the safetensors library.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from typing import Any

import torch

from spmd.checkpoint.metadata import CheckpointError, dtype_name
from spmd.checkpoint.storage import Buffer, Storage
from spmd.checkpoint.untrusted import strict_loads

ALIGN = 8
#: The largest safetensors header read (the safetensors library's own limit).
MAX_HEADER_BYTES = 100 * 2**20


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable, without a copy."""
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


def write_file(storage: Storage, path: str, tensors: Sequence[tuple[str, torch.Tensor]]) -> dict[str, tuple[int, int]]:
    """Write ``tensors`` (CPU) to ``path`` as one safetensors file; return name -> absolute (begin, end)."""
    header: dict[str, dict] = {}
    views: list[memoryview] = []
    position = 0
    for name, tensor in tensors:
        view = byte_view(tensor.detach().contiguous())
        header[name] = {"dtype": dtype_name(tensor.dtype), "shape": list(tensor.shape),
                        "data_offsets": [position, position + view.nbytes]}
        views.append(view)
        position += view.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % ALIGN)  # the data section starts aligned
    start = 8 + len(raw)
    storage.write(path, [struct.pack("<Q", len(raw)), raw, *views])
    return {name: (start + h["data_offsets"][0], start + h["data_offsets"][1]) for name, h in header.items()}


def tensor_from(buffer: Buffer, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """A tensor over ``buffer``'s bytes (no copy) with ``dtype`` and ``shape``."""
    if len(buffer) == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    if isinstance(buffer, bytes):  # torch.frombuffer wants a writable buffer
        buffer = bytearray(buffer)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).reshape(tuple(shape))


def read_header(storage: Storage, path: str, size: int, where: str) -> tuple[dict[str, Any], int]:
    """The JSON header of the ``size``-byte safetensors file ``path`` and the offset of its data section."""
    if size < 8:
        raise CheckpointError(f"{where} is {size} bytes, too short for a safetensors file; the checkpoint is damaged")
    (length,) = struct.unpack("<Q", bytes(storage.read(path, 0, 8)))
    if length > min(MAX_HEADER_BYTES, size - 8):
        raise CheckpointError(
            f"{where}: its safetensors header claims {length} bytes, more than the file's {size - 8} or the "
            f"{MAX_HEADER_BYTES} read; the checkpoint is damaged"
        )
    header = strict_loads(storage.read(path, 8, length), f"{where} (safetensors header)")
    if not isinstance(header, dict):
        raise CheckpointError(f"{where}: its safetensors header is not a JSON object; the checkpoint is damaged")
    return header, 8 + length
