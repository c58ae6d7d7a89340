"""What ``spmd checkpoint inspect|consolidate|import-torch`` do, as functions."""

from __future__ import annotations

import json
import math
from typing import Any

import torch

from spmd.checkpoint.load import read_box, read_metadata
from spmd.checkpoint.metadata import Metadata
from spmd.checkpoint.storage import open_storage


def _size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024  # type: ignore[assignment]
    return str(nbytes)


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def inspect(checkpoint_id: str) -> tuple[Metadata, str]:
    """The checkpoint's metadata and a table of every tensor and value."""
    meta = read_metadata(open_storage(checkpoint_id), checkpoint_id)
    rows = [["name", "shape", "dtype", "saved as", "chunks", "size"]]
    total = 0
    for key, e in meta.tensors.items():
        nbytes = math.prod(e.shape) * torch.empty((), dtype=e.torch_dtype).element_size()
        total += e.nbytes
        rows.append([key, "x".join(map(str, e.shape)) or "scalar", e.dtype, e.placements, str(len(e.chunks)), _size(nbytes)])
    lines = [
        f"checkpoint {checkpoint_id}: {len(meta.tensors)} tensors, {_size(total)} stored, "
        f"saved by {meta.world_size} ranks, data in {meta.data_dir}/",
        "",
        _table(rows),
    ]
    if meta.values:
        lines += ["", _table([["value", "content"], *[[k, json.dumps(v)[:80]] for k, v in meta.values.items()]])]
    return meta, "\n".join(lines)


def consolidate(checkpoint_id: str, out: str) -> int:
    """Write every tensor, full, to one ordinary safetensors file (values go to its ``__metadata__``); return the count."""
    from safetensors.torch import save_file

    storage = open_storage(checkpoint_id)
    meta = read_metadata(storage, checkpoint_id)
    tensors = {key: read_box(storage, key, e, ((0,) * len(e.shape), e.shape)) for key, e in meta.tensors.items()}
    save_file(tensors, out, metadata={k: json.dumps(v) for k, v in meta.values.items()})
    return len(tensors)


def import_torch(path: str, checkpoint_id: str) -> Any:
    """Convert a ``torch.save``d state dict into a checkpoint (unpickles ``path`` with ``weights_only=True``)."""
    from spmd.checkpoint.save import save

    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise ValueError(f"{path} holds a {type(state).__name__}, not a state dict")
    save(state, checkpoint_id)
    return state
