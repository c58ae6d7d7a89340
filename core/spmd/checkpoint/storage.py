"""The Storage contract, StorageSpec, and the scheme registry that the ``spmd_storages`` plugins fill."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from spmd import hookspecs
from spmd.errors import NotProvidedError
from spmd.registry import Entry, Registry

#: A scheme that serves every URL whose scheme no other spec names (the fsspec plugin's).
ANY_SCHEME = "*"

Buffer = bytes | bytearray | memoryview


class Storage:
    """Where one checkpoint's files live: paths are relative to the checkpoint's root, ``/``-separated.

    Implemented by storage plugins. spmd calls these from several ranks at
    once (each rank writes only its own files) and from a background thread
    during ``async_save``; a Storage must be safe to use from one thread at a
    time per instance. ``write_atomic`` is the commit point: readers see the
    old content or the new, never a part. ``read`` reads a byte range, so a
    rank that needs a slice of a shard reads only that slice. A checkpoint is
    untrusted input: the read side (``read``, ``read_into``, ``size``) should
    refuse a path that leaves the root, a symbolic link and anything but a
    regular file, and never block (the builtin storages do).
    """

    def write(self, path: str, parts: Iterable[Buffer]) -> int:
        """Create or replace ``path`` with the concatenation of ``parts``; return the bytes written."""
        raise NotImplementedError

    def write_atomic(self, path: str, data: bytes) -> None:
        """Replace ``path`` with ``data`` so that a reader sees the old file or the new one, never a mix."""
        raise NotImplementedError

    def read(self, path: str, offset: int = 0, length: int | None = None) -> Buffer:
        """``length`` bytes of ``path`` from ``offset`` (to the end when None)."""
        raise NotImplementedError

    def size(self, path: str) -> int:
        """The size of the regular file ``path``: an error if it is missing or not a regular file.

        spmd calls it before reading a file a checkpoint names, to bound what it
        reads; override it to ask without reading (this default reads the file).
        """
        return len(self.read(path))

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes of ``path`` from ``offset`` (override to read without a copy)."""
        out[:] = memoryview(self.read(path, offset, out.nbytes)).cast("B")

    def exists(self, path: str) -> bool:
        """Whether ``path`` (a file or a directory) exists."""
        raise NotImplementedError

    def listdir(self, path: str = "") -> list[str]:
        """The names directly under directory ``path`` (empty when it does not exist)."""
        raise NotImplementedError

    def remove(self, path: str) -> None:
        """Delete a file or a directory tree; a missing path is not an error."""
        raise NotImplementedError

    def local_path(self, path: str) -> str | None:
        """A local file-system path for ``path`` if there is one (tools may open it directly), else None."""
        return None

    def create_exclusive(self, path: str, data: bytes) -> bool:
        """Create ``path`` with ``data`` only if it does not exist; False if it does (a save's claim uses this).

        Optional: this default, built on ``exists``, ``write_atomic`` and
        ``read``, is not atomic against a writer that checks at the same
        instant (both may see True); spmd re-reads the claim before it
        commits, so one of two such savers still fails instead of both
        committing. Override it with the storage's own create-if-absent
        (``O_EXCL``, a conditional put) to make the check exact.
        """
        if self.exists(path):
            return False
        self.write_atomic(path, data)
        return bytes(self.read(path)) == data


@dataclass(frozen=True)
class StorageSpec:
    """What ``spmd_storages()`` returns: URL schemes and ``factory(url) -> Storage``.

    ``schemes`` are lower-case names without ``://`` (``("s3", "s3a")``); the
    scheme ``"*"`` serves every URL that no other spec claims. ``overrides``
    lets this spec win over another plugin's for the same scheme.
    """

    schemes: tuple[str, ...]
    factory: Callable[[str], Storage]
    name: str = ""
    description: str = ""
    overrides: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.schemes, str):
            object.__setattr__(self, "schemes", (self.schemes,))
        object.__setattr__(self, "schemes", tuple(s.lower() for s in self.schemes))
        if not self.name:
            object.__setattr__(self, "name", ",".join(self.schemes))


class StorageNotFoundError(NotProvidedError):
    """No loaded plugin serves the URL's scheme."""


#: A StorageSpec and the plugin that provided it.
RegisteredStorage = Entry[str, StorageSpec]

STORAGES: Registry[str, StorageSpec] = Registry(
    hookspecs.spmd_storages, "storage scheme", StorageSpec, plural="schemes", keys=lambda spec: spec.schemes, missing=StorageNotFoundError)


def storages() -> dict[str, RegisteredStorage]:
    """Every registered storage by scheme (rebuilt when the plugins change)."""
    return STORAGES.entries()


def reset() -> None:
    """Forget the collected schemes (they are collected again on next use)."""
    STORAGES.reset()


def scheme_of(url: str) -> str:
    """The URL's scheme, lower-case; ``file`` for a plain path (``C:\\`` drive letters included)."""
    head, sep, _ = str(url).partition("://")
    if not sep or len(head) < 2 or not head.replace("+", "").replace("-", "").replace(".", "").isalnum():
        return "file"
    return head.lower()


def open_storage(url: str) -> Storage:
    """The Storage for ``url`` from the plugin that serves its scheme, or an error naming the way out."""
    registry = storages()
    scheme = scheme_of(url)
    entry = registry.get(scheme) or registry.get(ANY_SCHEME)
    if entry is None:
        known = ", ".join(sorted(s for s in registry if s != ANY_SCHEME)) or "none"
        raise StorageNotFoundError(
            f"no storage plugin serves {scheme}:// (checkpoint {url!r}); schemes available: {known}. "
            "Install fsspec for fsspec URLs (pip install 'spmd[fsspec]', plus s3fs/gcsfs for s3://, gs://), "
            "or add a plugin whose spmd_storages() names the scheme; `spmd plugins` lists what is loaded"
        )
    return entry.spec.factory(str(url))


def checkpoint_location(checkpoint_id: str | os.PathLike | None, storage: Any, what: str) -> str:
    """The checkpoint URL from ``checkpoint_id`` or torch's ``storage_writer``/``storage_reader`` (its ``checkpoint_id``)."""
    if storage is not None:
        location = getattr(storage, "checkpoint_id", None)
        if location is None:
            raise TypeError(
                f"{what}: spmd takes storage_writer/storage_reader objects that name a location "
                f"(spmd.checkpoint.FileSystemWriter/FileSystemReader), not {type(storage).__name__}; "
                "or pass checkpoint_id=path (any storage plugin's URL)"
            )
        if checkpoint_id is not None and os.fspath(checkpoint_id) != os.fspath(location):
            raise ValueError(f"{what}: checkpoint_id {checkpoint_id!r} and the storage's {location!r} differ; give one")
        return os.fspath(location)
    if checkpoint_id is None:
        raise TypeError(f"{what}: pass checkpoint_id= (a path or a storage URL) or storage_writer=/storage_reader=")
    return os.fspath(checkpoint_id)
