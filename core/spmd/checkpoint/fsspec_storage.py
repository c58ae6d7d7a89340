"""The builtin-optional storage plugin: every fsspec URL (``memory://``, ``s3://`` with s3fs, ...).

It serves the wildcard scheme, so a plugin that names a scheme exactly wins
over it. fsspec itself is imported only when a URL is opened.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from typing import Any

from spmd.checkpoint.filesystem import FileStorage
from spmd.checkpoint.metadata import CheckpointError, CheckpointFileMissing
from spmd.checkpoint.storage import ANY_SCHEME, Buffer, Storage, StorageSpec
from spmd.checkpoint.untrusted import check_range, check_relative
from spmd.markers import hookimpl


class FsspecStorage(Storage):
    """A checkpoint under an fsspec URL; ``write_atomic`` relies on the file system's whole-object put.

    Reads check names as the file storage does; on fsspec's local file system they go through the file storage.
    """

    def __init__(self, url: str) -> None:
        import fsspec

        self.fs: Any
        self.fs, root = fsspec.core.url_to_fs(url)
        self.root = root.rstrip("/")
        from fsspec.implementations.local import LocalFileSystem

        #: On fsspec's local file system, reads go through the file storage (its checks: no links, no FIFOs).
        self.local = FileStorage(self.root) if isinstance(self.fs, LocalFileSystem) else None

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

    def size(self, path: str) -> int:
        local = self.local
        if local is not None:  # the file storage's checks: no links, no FIFOs, nothing outside the root
            return local.size(path)
        where = self._path(path)
        check_relative(path, where)
        try:
            info = self.fs.info(where)
        except FileNotFoundError:
            raise CheckpointFileMissing(f"{where} does not exist; the checkpoint is incomplete or damaged") from None
        if info.get("type") != "file" or info.get("islink") or type(info.get("size")) is not int:
            raise CheckpointError(f"{where} is not a regular file (fsspec says {info.get('type')!r}); refused")
        return int(info["size"])

    def read(self, path: str, offset: int = 0, length: int | None = None) -> Buffer:
        local = self.local
        if local is not None:
            return local.read(path, offset, length)
        size = self.size(path)
        length = max(size - offset, 0) if length is None else length
        check_range(self._path(path), size, offset, length)
        data = self.fs.cat_file(self._path(path), start=offset, end=offset + length)
        if len(data) != length:
            raise CheckpointError(f"{self._path(path)} ends before byte {offset + length} (it shrank while read)")
        return data

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        if self.local is not None:
            self.local.read_into(path, offset, out)
        else:
            super().read_into(path, offset, out)

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
