"""The builtin-optional storage plugin: every fsspec URL (``memory://``, ``s3://`` with s3fs, ...).

It serves the wildcard scheme, so a plugin that names a scheme exactly wins
over it. fsspec itself is imported only when a URL is opened.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from typing import Any

from spmd.checkpoint.storage import ANY_SCHEME, Buffer, Storage, StorageSpec
from spmd.markers import hookimpl


class FsspecStorage(Storage):
    """A checkpoint under an fsspec URL; ``write_atomic`` relies on the file system's whole-object put."""

    def __init__(self, url: str) -> None:
        import fsspec

        self.fs: Any
        self.fs, root = fsspec.core.url_to_fs(url)
        self.root = root.rstrip("/")

    def _path(self, path: str) -> str:
        return f"{self.root}/{path}" if path else self.root

    def write(self, path: str, parts: Iterable[Buffer]) -> int:
        total = 0
        target = self._path(path)
        parent = target.rsplit("/", 1)[0]
        self.fs.makedirs(parent, exist_ok=True)
        with self.fs.open(target, "wb") as f:
            for part in parts:
                view = memoryview(part).cast("B")
                f.write(view)
                total += view.nbytes
        return total

    def write_atomic(self, path: str, data: bytes) -> None:
        target = self._path(path)
        self.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
        self.fs.pipe_file(target, data)

    def read(self, path: str, offset: int = 0, length: int | None = None) -> Buffer:
        end = None if length is None else offset + length
        return self.fs.cat_file(self._path(path), start=offset, end=end)

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(self._path(path)))

    def listdir(self, path: str = "") -> list[str]:
        target = self._path(path)
        if not self.fs.isdir(target):
            return []
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(target, detail=False))

    def remove(self, path: str) -> None:
        target = self._path(path)
        if self.fs.exists(target):
            self.fs.rm(target, recursive=True)

    def create_exclusive(self, path: str, data: bytes) -> bool:
        target = self._path(path)
        self.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
        try:
            with self.fs.open(target, "xb") as f:  # local, memory, and object stores with conditional puts
                f.write(data)
        except FileExistsError:
            return False
        except (ValueError, NotImplementedError):  # a file system without mode "x": the generic check
            return super().create_exclusive(path, data)
        return True


@hookimpl
def spmd_storages() -> list[StorageSpec]:
    """Every scheme no other plugin names, through fsspec, when fsspec is installed."""
    if importlib.util.find_spec("fsspec") is None:
        return []
    return [StorageSpec((ANY_SCHEME,), FsspecStorage, name="fsspec", description="any fsspec URL (memory://, s3://, ...)")]
