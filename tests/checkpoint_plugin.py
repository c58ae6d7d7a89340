"""A third-party storage plugin for the checkpoint tests: ``flat://`` and the failing ``failing://``.

``flat://DIR`` keeps every file of a checkpoint directly in DIR, its path
flattened (``data-x/rank-00000.safetensors`` -> ``data-x~rank-00000.safetensors``),
so a test can tell that spmd went through this plugin and not the builtin
file storage. ``failing://DIR`` writes like the file storage but every
safetensors write of rank 1 fails as a full disk would. The others (dying,
slow, held, killed, commit-dies) are the file storage with one fault each.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

import spmd
from spmd.checkpoint import StorageSpec
from spmd.checkpoint.filesystem import FileStorage
from spmd.checkpoint.metadata import METADATA_FILE
from spmd.checkpoint.storage import Buffer
from spmd.polling import poll

#: Bytes read from safetensors files through ``flat://`` in this process.
BYTES_READ = [0]


class FlatStorage(FileStorage):
    """Files of every directory level side by side, ``/`` written as ``~``; counts the shard bytes it reads."""

    def __init__(self, url: str) -> None:
        super().__init__(url[len("flat://") :])

    def _path(self, path: str) -> str:
        return os.path.join(self.root, path.replace("/", "~")) if path else self.root

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        if path.endswith(".safetensors"):
            BYTES_READ[0] += out.nbytes
        super().read_into(path, offset, out)

    def listdir(self, path: str = "") -> list[str]:
        if path:
            prefix = path.replace("/", "~") + "~"
            return sorted(n[len(prefix) :] for n in os.listdir(self.root) if n.startswith(prefix))
        return sorted({n.split("~")[0] for n in os.listdir(self.root)}) if os.path.isdir(self.root) else []

    def exists(self, path: str) -> bool:
        return super().exists(path) or bool(self.listdir(path))

    def remove(self, path: str) -> None:
        for name in self.listdir(path):
            os.unlink(self._path(f"{path}/{name}"))
        super().remove(path)


class FailingStorage(FileStorage):
    """The file storage, except that rank 1's safetensors writes fail half-way."""

    def __init__(self, url: str) -> None:
        super().__init__(url[len("failing://") :])

    def write(self, path: str, parts: Iterable[Buffer]) -> int:
        if path.endswith(".safetensors") and spmd.get_rank() == 1:
            first = next(iter(parts))
            super().write(path, [first])  # a truncated file, as a full disk leaves it
            raise OSError(28, "No space left on device (simulated)")
        return super().write(path, parts)


class FullStorage(FileStorage):
    """The file storage on a full disk: every safetensors write fails (on every rank, or in a process alone)."""

    def __init__(self, url: str) -> None:
        super().__init__(url[len("full://") :])

    def write(self, path: str, parts: Iterable[Buffer]) -> int:
        if path.endswith(".safetensors"):
            raise OSError(28, "No space left on device (simulated)")
        return super().write(path, parts)


class DyingStorage(FileStorage):
    """The file storage, except that rank 1 dies (``os._exit``) half-way through its safetensors write."""

    def __init__(self, url: str) -> None:
        super().__init__(url[len("dying://") :])

    def write(self, path: str, parts: Iterable[Buffer]) -> int:
        if path.endswith(".safetensors") and spmd.get_rank() == 1:
            super().write(path, [next(iter(parts))])
            os._exit(3)  # a killed rank: no exception, no clean-up, no goodbye
        return super().write(path, parts)


class SlowStorage(FileStorage):
    """The file storage, except that each safetensors write first waits ``SLOW_WRITE_S`` seconds (default 1)."""

    def __init__(self, url: str) -> None:
        super().__init__(url[len("slow://") :])

    def write(self, path: str, parts: Iterable[Buffer]) -> int:
        if path.endswith(".safetensors"):
            time.sleep(float(os.environ.get("SLOW_WRITE_S", "1")))
        return super().write(path, parts)


class HeldStorage(FileStorage):
    """The file storage, except that a save waits after writing its data: it creates ``<root>.ready``, then waits
    (60 s at most) for ``<root>.go``, so a test can act while this save holds the id and has not committed."""

    def __init__(self, url: str) -> None:
        super().__init__(url[len("held://") :])

    def write(self, path: str, parts: Iterable[Buffer]) -> int:
        written = super().write(path, parts)
        if path.endswith(".safetensors"):
            with open(f"{self.root}.ready", "w"):
                pass
            poll(lambda: os.path.exists(f"{self.root}.go"), 60, 0.01)
        return written


class KilledStorage(FileStorage):
    """The file storage, except that the process dies (``os._exit(9)``) half-way through its first safetensors write:
    a whole job killed mid-save."""

    def __init__(self, url: str) -> None:
        super().__init__(url[len("killed://") :])

    def write(self, path: str, parts: Iterable[Buffer]) -> int:
        if path.endswith(".safetensors"):
            super().write(path, [next(iter(parts))])
            os._exit(9)
        return super().write(path, parts)


class CommitThenDieStorage(FileStorage):
    """The file storage, except that rank 0 dies (``os._exit(5)``) right after it has committed ``metadata.json``."""

    def __init__(self, url: str) -> None:
        super().__init__(url[len("commit-dies://") :])

    def write_atomic(self, path: str, data: bytes) -> None:
        super().write_atomic(path, data)
        if path == METADATA_FILE and spmd.get_rank() == 0:
            os._exit(5)


@spmd.hookimpl
def spmd_storages() -> list[StorageSpec]:
    return [
        StorageSpec(("flat",), FlatStorage, name="flat", description="test: one flat directory"),
        StorageSpec(("failing",), FailingStorage, name="failing", description="test: rank 1's writes fail"),
        StorageSpec(("dying",), DyingStorage, name="dying", description="test: rank 1 dies while writing"),
        StorageSpec(("full",), FullStorage, name="full", description="test: every safetensors write fails"),
        StorageSpec(("slow",), SlowStorage, name="slow", description="test: every safetensors write waits"),
        StorageSpec(("held",), HeldStorage, name="held", description="test: the commit waits for a go file"),
        StorageSpec(("killed",), KilledStorage, name="killed", description="test: the process dies while writing"),
        StorageSpec(("commit-dies",), CommitThenDieStorage, name="commit-dies", description="test: rank 0 dies after the commit"),
    ]
