"""The builtin storage plugin: local paths and ``file://`` URLs."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterable

from spmd.checkpoint.localread import open_regular, pread_exact
from spmd.checkpoint.metadata import CheckpointError
from spmd.checkpoint.storage import Buffer, Storage, StorageSpec
from spmd.checkpoint.untrusted import check_range, check_relative
from spmd.markers import hookimpl


def _fsync_directory(path: str) -> None:
    """Flush a directory's entries (new names, renames) to disk; a no-op where directories cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on a directory
        pass
    finally:
        os.close(fd)


def _synced_temporary(target: str, data: bytes) -> str:
    """``data`` on disk in a new temporary file beside ``target`` (its directory made if need be); its path."""
    os.makedirs(os.path.dirname(target), exist_ok=True)
    temporary = f"{target}.{uuid.uuid4().hex}.tmp"
    try:
        with open(temporary, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:  # a full disk: no half-written temporary left behind
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
    return temporary


class FileStorage(Storage):
    """A checkpoint in a local (or mounted) directory; writes go through ``os.write`` and ``fsync``, reads through ``os.preadv``.

    Reads refuse a path outside the root, a symbolic link below it and anything but a regular file, without blocking.
    """

    def __init__(self, url: str) -> None:
        self.root = os.path.abspath(url[len("file://") :] if url.startswith("file://") else url)

    def _path(self, path: str) -> str:
        return os.path.join(self.root, *path.split("/")) if path else self.root

    def write(self, path: str, parts: Iterable[Buffer]) -> int:
        target = self._path(path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        total = 0
        with open(target, "wb", buffering=0) as f:
            for part in parts:
                view = memoryview(part).cast("B")
                while view:
                    n = f.write(view)
                    assert n is not None
                    total += n
                    view = view[n:]
            os.fsync(f.fileno())  # on disk before metadata.json commits it (torch's DCP syncs too)
        _fsync_directory(os.path.dirname(target))  # and its name in the directory, or a power loss may drop it
        return total

    def write_atomic(self, path: str, data: bytes) -> None:
        target = self._path(path)
        temporary = _synced_temporary(target, data)
        try:
            os.replace(temporary, target)
            _fsync_directory(os.path.dirname(target))  # the commit itself survives a power loss
        finally:
            if os.path.exists(temporary):
                os.unlink(temporary)

    def _open(self, path: str) -> tuple[int, int, str]:
        """A descriptor of the regular file ``path`` inside the root, its size and its name for errors."""
        where = self._path(path) if path else self.root
        check_relative(path, where)
        parts = os.path.relpath(self._path(path), self.root).split(os.sep)
        if any(part in ("", os.curdir, os.pardir) for part in parts):  # a subclass's _path that leaves the root
            raise CheckpointError(f"{where} is not inside the checkpoint directory {self.root}; refused")
        fd, size = open_regular(self.root, parts, where)
        return fd, size, where

    def read(self, path: str, offset: int = 0, length: int | None = None) -> Buffer:
        fd, size, where = self._open(path)
        try:
            if length is None:
                length = max(size - offset, 0)
            check_range(where, size, offset, length)
            buffer = bytearray(length)
            pread_exact(fd, size, offset, memoryview(buffer), where)
        finally:
            os.close(fd)
        return buffer

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        fd, size, where = self._open(path)
        try:
            pread_exact(fd, size, offset, out, where)
        finally:
            os.close(fd)

    def size(self, path: str) -> int:
        fd, size, _ = self._open(path)
        os.close(fd)
        return size

    def exists(self, path: str) -> bool:
        return os.path.exists(self._path(path))

    def listdir(self, path: str = "") -> list[str]:
        target = self._path(path)
        return sorted(os.listdir(target)) if os.path.isdir(target) else []

    def remove(self, path: str) -> None:
        target = self._path(path)
        if os.path.isdir(target):
            shutil.rmtree(target, ignore_errors=True)
        elif os.path.exists(target):
            os.unlink(target)

    def local_path(self, path: str) -> str | None:
        return self._path(path)

    def create_exclusive(self, path: str, data: bytes) -> bool:
        """Write a temporary file, then hard-link it to ``path``: the name appears with its whole content or not at all."""
        target = self._path(path)
        temporary = _synced_temporary(target, data)
        try:
            try:
                os.link(temporary, target)
            except FileExistsError:
                return False
            except OSError:  # a file system without hard links: O_EXCL (a reader may see it empty for a moment)
                return self._create_excl(target, data)
        finally:
            if os.path.exists(temporary):
                os.unlink(temporary)
        _fsync_directory(os.path.dirname(target))
        return True

    @staticmethod
    def _create_excl(target: str, data: bytes) -> bool:
        try:
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        return True


@hookimpl
def spmd_storages() -> list[StorageSpec]:
    """Local directories: plain paths and ``file://``."""
    return [StorageSpec(("file",), FileStorage, name="file", description="local or mounted directories")]


class FileSystemWriter:
    """torch's ``storage_writer`` for a directory: ``save(sd, storage_writer=FileSystemWriter(path))`` is ``save(sd, checkpoint_id=path)``.

    torch's tuning options are accepted and not used: spmd writes one
    safetensors file per writing rank and always syncs the files it writes.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        thread_count: int = 1,
        per_thread_copy_ahead: int = 10_000_000,
        cache_staged_state_dict: bool = False,
        overwrite: bool = True,
    ) -> None:
        self.checkpoint_id = os.fspath(path)
        self.overwrite = overwrite


class FileSystemReader:
    """torch's ``storage_reader`` for a directory: ``load(sd, storage_reader=FileSystemReader(path))`` is ``load(sd, checkpoint_id=path)``."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.checkpoint_id = os.fspath(path)
