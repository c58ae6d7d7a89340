"""What ``spmd checkpoint inspect|consolidate|import-torch`` do, as functions."""

from __future__ import annotations

import json
import math
import os
import pickle
from typing import Any

import torch

from spmd.checkpoint.datafiles import DataFiles
from spmd.checkpoint.load import read_box, read_metadata
from spmd.checkpoint.metadata import CheckpointError, Metadata
from spmd.checkpoint.storage import open_storage
from spmd.errors import first_line


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
    """The checkpoint's metadata and a table of every tensor and value; every data file's header is checked too."""
    storage = open_storage(checkpoint_id)
    meta = read_metadata(storage, checkpoint_id)
    files = DataFiles(storage, checkpoint_id)
    for entry in meta.tensors.values():
        for chunk in entry.chunks:
            files.check(entry, chunk)
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
    files = DataFiles(storage, checkpoint_id)
    tensors = {key: read_box(files, key, e, ((0,) * len(e.shape), e.shape)) for key, e in meta.tensors.items()}
    save_file(tensors, out, metadata={k: json.dumps(v) for k, v in meta.values.items()})
    return len(tensors)


def _unpickle(path: str) -> Any:
    """``torch.load(path, weights_only=True)``; a refused or unreadable file is one CheckpointError line."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is not a regular file; import-torch reads a file written by torch.save")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        paragraphs = [p.strip() for p in str(error).split("\n\n") if p.strip()]
        reason = next((p for p in paragraphs[1:] if not p.startswith("Check the documentation")), first_line(error))
        raise CheckpointError(
            f"{path} was refused by torch.load(weights_only=True): {' '.join(reason.split()).rstrip('.')}; import-torch reads "
            "only torch.save files of tensors and plain containers, nothing that runs code when unpickled"
        ) from None
    except Exception as error:  # noqa: BLE001 - torch.load of a damaged file raises KeyError, EOFError, RuntimeError...
        raise CheckpointError(
            f"{path} is not a readable torch.save file ({type(error).__name__}: {first_line(error)})"
        ) from None


def import_torch(path: str, checkpoint_id: str) -> Any:
    """Convert a ``torch.save``d state dict into a checkpoint (unpickles ``path`` with ``weights_only=True``)."""
    from spmd.checkpoint.save import save

    state = _unpickle(path)
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not a state dict")
    save(state, checkpoint_id)
    return state
