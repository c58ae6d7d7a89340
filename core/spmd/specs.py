"""The plain types the hooks exchange: what a plugin declares, and the contracts it implements.

Floor 1 of the kernel: this module imports nothing of spmd, so ``hookspecs``
can name these types at run time and every package can take them from here
without importing another package. Each type is also importable where it is
used (``spmd.comm.backend.BackendSpec``, ``spmd.checkpoint.StorageSpec``, ...).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, ClassVar, Protocol

Buffer = bytes | bytearray | memoryview

#: What a DDP communication hook is: ``hook(state, bucket: spmd.parallel.buckets.GradBucket) -> spmd.Work``.
CommHook = Callable[[Any, Any], Any]

#: What a bench peer factory returns: op name -> ``make(nbytes) -> call()``.
PeerMakers = Mapping[str, Callable[[int], Callable[[], object]]]


@dataclass(frozen=True)
class BackendContext:
    """Everything a backend factory needs to build one group's backend on one device type."""

    rank: int
    size: int
    store: Any  # a torch.distributed.Store, already prefixed for this group and device
    timeout: timedelta
    group_name: str
    options: dict[str, Any] = field(default_factory=dict)
    device_type: str = "cpu"
    global_ranks: tuple[int, ...] = ()


class BackendCapabilities(Protocol):
    """What the kernel reads off a backend before it builds one (``spmd.comm.backend.Backend`` has both)."""

    supports_avg: ClassVar[bool]

    @classmethod
    def native_ops(cls) -> frozenset[str]:
        """The collectives the class implements natively."""
        ...


@dataclass(frozen=True)
class BackendSpec:
    """What a plugin declares about one backend (returned from ``spmd_backends``).

    ``factory(ctx)`` builds the Backend; keep heavy native imports inside it.
    ``available()`` returns None when the native dependency is usable, else the
    reason it is not (``spmd doctor`` prints it; it must not import heavily
    either where a cheap check exists). Higher ``priority`` wins when
    ``spmd.init()`` picks a backend by itself. ``overrides=True`` lets this
    spec replace another plugin's spec of the same name instead of conflicting.
    """

    name: str
    devices: tuple[str, ...]
    #: Builds a ``spmd.comm.backend.Backend`` (the kernel refuses anything else by name).
    factory: Callable[[BackendContext], BackendCapabilities]
    priority: int = 0
    available: Callable[[], str | None] | None = None
    #: The Backend subclass ``factory`` builds, or its path ``"module:Class"`` (imported only
    #: when asked, by ``spmd doctor``): its overrides and ``supports_avg`` are the backend's
    #: capabilities. Not needed when ``factory`` is the class itself.
    backend_class: type[BackendCapabilities] | str | None = None
    description: str = ""
    overrides: bool = False
    #: ``precheck(ctx)``: None, or why this backend cannot serve ``ctx``'s group at all (a
    #: launcher that does not match the library...). Called at the group's first use, before the
    #: kernel waits for the other members, so a misconfiguration is named at once instead of
    #: after a timeout; it may load the native library, and must not wait for peers.
    precheck: Callable[[BackendContext], str | None] | None = None
    #: The backend serves only groups whose ranks share one host (shared memory): the kernel's own
    #: choice (``spmd.init()`` without a backend) passes it over for a group that spans hosts and takes
    #: the next usable one, so such a backend can have the highest priority. Asked for by name, it is
    #: used regardless (and its own check names the ranks that are elsewhere).
    one_host: bool = False
    #: A command prefix that starts this backend's ranks (``("mpiexec", "-n", "{nproc}")``),
    #: for tools that launch jobs themselves (``spmd bench``); None means plain processes.
    launch: tuple[str, ...] | None = None
    #: ``where_it_binds(binding)``: the address or interface this backend will use on this node and
    #: why, given the kernel's ``spmd.comm.address.Binding`` (``spmd doctor`` prints it); None: not told.
    where_it_binds: Callable[[Any], str] | None = None

    def backend_type(self) -> type[BackendCapabilities] | None:
        """The Backend subclass this spec builds (``backend_class``, or ``factory`` when it is one), or None."""
        cls = self.backend_class
        if isinstance(cls, str):
            module, _, name = cls.partition(":")
            cls = getattr(importlib.import_module(module), name)
        if cls is None and isinstance(self.factory, type) and callable(getattr(self.factory, "native_ops", None)):
            cls = self.factory  # the factory is the Backend class itself
        return cls

    def native_ops(self) -> frozenset[str] | None:
        """The collectives this backend implements natively, read off its class; None if the spec names none."""
        cls = self.backend_type()
        return cls.native_ops() if cls is not None else None

    def unavailable_reason(self) -> str | None:
        """None if usable here, else why not."""
        if self.available is None:
            return None
        try:
            return self.available()
        except Exception as error:  # noqa: BLE001 - a broken check is itself the reason
            return f"availability check raised {type(error).__name__}: {error}"


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


@dataclass(frozen=True)
class StrategySpec:
    """A parallelism strategy a plugin provides: ``apply(module, **options)`` returns the parallel module."""

    name: str
    apply: Callable[..., Any]
    description: str = ""
    overrides: bool = False  # True: wins over a same-named spec from another plugin


@dataclass(frozen=True)
class LaunchInfo:
    """Where this process sits in the job, as its launcher told it."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


class ClusterEnvironment(Protocol):
    """What ``spmd_cluster_environments`` returns: one launcher's view of rank, world and master.

    ``detect`` must be cheap and side-effect free (it reads environment
    variables); ``launch_info`` is called only on the environment that detected.
    """

    name: str
    #: Higher is asked first (a scheduler's variables outrank a generic launcher's).
    priority: int

    def detect(self) -> bool: ...

    def launch_info(self) -> LaunchInfo: ...


@dataclass(frozen=True)
class RendezvousBackendSpec:
    """What ``spmd_rendezvous_backends()`` returns: ``--rdzv-backend NAME`` and ``factory(config) -> RendezvousBackend``.

    ``factory`` takes the agent's ``spmd.launch.args.RunConfig`` and returns a
    ``spmd.launch.rdzv_backends.RendezvousBackend`` (the agent refuses anything else by name).
    """

    name: str
    factory: Callable[[Any], object]
    description: str = ""
    overrides: bool = False


@dataclass(frozen=True)
class PeerContext:
    """What a raw-library peer needs to build its side: the world and a private store prefix."""

    rank: int
    world_size: int
    store: Any
    timeout_s: float
