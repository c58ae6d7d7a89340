"""A checkpoint's safetensors files, each checked against ``metadata.json`` before any of its chunks is read.

The metadata says where each chunk's bytes are; the file's own header must
agree (same name, dtype, shape and byte range) and the file must be long
enough, so a relabelled dtype or a truncated file is an error, not
reinterpreted bytes or a read past the end.
"""

from __future__ import annotations

from typing import Any

from spmd.checkpoint.metadata import CheckpointError, Chunk, TensorEntry
from spmd.checkpoint.safetensors_io import read_header
from spmd.checkpoint.storage import Storage
from spmd.checkpoint.untrusted import show


class DataFiles:
    """The data files of one checkpoint read by one call: each file's size and header read once."""

    def __init__(self, storage: Storage, checkpoint_id: str) -> None:
        self.storage = storage
        self.checkpoint_id = checkpoint_id
        self._files: dict[str, tuple[dict[str, Any], int, int]] = {}

    def _file(self, path: str) -> tuple[dict[str, Any], int, int]:
        found = self._files.get(path)
        if found is None:
            size = self.storage.size(path)
            header, start = read_header(self.storage, path, size, f"{self.checkpoint_id}/{path}")
            found = self._files[path] = (header, start, size)
        return found

    def check(self, entry: TensorEntry, chunk: Chunk) -> None:
        """Refuse ``chunk`` unless its file's header stores it as the metadata says, within the file."""
        header, start, size = self._file(chunk.file)
        where = f"{self.checkpoint_id}/{chunk.file}"
        stored = header.get(chunk.name)
        if not isinstance(stored, dict):
            raise CheckpointError(
                f"{where} holds no tensor {show(chunk.name)}, which metadata.json places there; the checkpoint is damaged"
            )
        if chunk.begin < start or chunk.end > size:
            raise CheckpointError(
                f"{where}: metadata.json places {show(chunk.name)} at bytes {chunk.begin}-{chunk.end}, outside the "
                f"file's data ({start}-{size}); the checkpoint is damaged or truncated"
            )
        expected = {"dtype": entry.dtype, "shape": list(chunk.sizes), "data_offsets": [chunk.begin - start, chunk.end - start]}
        for field, want in expected.items():
            if stored.get(field) != want:
                raise CheckpointError(
                    f"{where}: its header stores {show(chunk.name)} with {field} {show(stored.get(field))}, but "
                    f"metadata.json says {want}; the checkpoint is damaged (or one of them was edited)"
                )
