"""The scheme registry that the ``spmd_storages`` plugins fill (the Storage contract and StorageSpec are ``spmd.specs``', named here too)."""

from __future__ import annotations

import os
from typing import Any

from spmd import hookspecs
from spmd.errors import NotProvidedError
from spmd.registry import Entry, Registry
from spmd.specs import Buffer as Buffer
from spmd.specs import Storage, StorageSpec

#: A scheme that serves every URL whose scheme no other spec names (the fsspec plugin's).
ANY_SCHEME = "*"


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
