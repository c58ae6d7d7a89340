"""Writing safetensors files straight from tensor memory (no concatenated copy), and reading byte ranges.

The format: an 8-byte little-endian header length, a JSON header
(name -> dtype, shape, data_offsets relative to the data section), then the
data. Files written here open with the safetensors library.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence

import torch

from spmd.checkpoint.metadata import dtype_name
from spmd.checkpoint.storage import Buffer, Storage

ALIGN = 8


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
