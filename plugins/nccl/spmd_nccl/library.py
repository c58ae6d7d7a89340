"""The NCCL shared library, found and bound through ctypes: nothing is compiled.

Where the library comes from, in order:

1. ``SPMD_NCCL_LIBRARY`` (a path to a ``libnccl.so.2``): used as given, and an
   error if it does not exist or does not load;
2. an NVIDIA NCCL wheel: ``nvidia-nccl-cu12`` (this plugin's dependency) or
   ``nvidia-nccl-cu13`` put it in ``nvidia/nccl/lib/libnccl.so.2``, located
   through the installed ``nvidia.nccl`` package wherever pip put it (the CUDA
   13 wheel family's ``nvidia/cu13/lib`` is looked at too);
3. the system's ``libnccl.so.2``, through the dynamic loader's search path.

Every bound symbol carries exact ``argtypes``/``restype`` (``FUNCTIONS``), so
a wrong call fails in ctypes instead of corrupting the stack. The bindings
follow ``nccl.h``; ``ncclConfig_t`` is a versioned, append-only struct, and
``make_config`` fills the prefix that the loaded library knows (see there).

Loading is lazy (``load()``) and cached per path; importing this module loads
nothing. Only ``ctypes``, ``os`` and ``importlib`` are used here: no torch.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: The environment variable that names the library file explicitly.
ENV_VAR = "SPMD_NCCL_LIBRARY"
#: The soname the dynamic loader is asked for last.
SONAME = "libnccl.so.2"
#: How a library found in an NVIDIA wheel is described.
WHEEL_SOURCE = "the nvidia-nccl wheel"
#: What to install when no library is found.
INSTALL_HINT = "pip install nvidia-nccl-cu12 (pulled in by: pip install -e plugins/nccl, or pip install 'spmd[nccl]')"

# -- nccl.h types -----------------------------------------------------------------------
ncclResult_t = ctypes.c_int
ncclComm_t = ctypes.c_void_p
ncclDataType_t = ctypes.c_int
ncclRedOp_t = ctypes.c_int
cudaStream_t = ctypes.c_void_p
buffer_t = ctypes.c_void_p
#: ``ncclConfig_t*``: the struct's layout depends on the library version, so it travels as a pointer.
config_p = ctypes.c_void_p

NCCL_UNIQUE_ID_BYTES = 128


class ncclUniqueId(ctypes.Structure):  # noqa: N801 - nccl.h's name
    """``typedef struct { char internal[NCCL_UNIQUE_ID_BYTES]; } ncclUniqueId;`` (passed by value)."""

    _fields_ = [("internal", ctypes.c_char * NCCL_UNIQUE_ID_BYTES)]


# ncclResult_t
ncclSuccess = 0
ncclUnhandledCudaError = 1
ncclSystemError = 2
ncclInternalError = 3
ncclInvalidArgument = 4
ncclInvalidUsage = 5
ncclRemoteError = 6
ncclInProgress = 7
ncclTimeout = 8
RESULT_NAMES = {
    0: "ncclSuccess", 1: "ncclUnhandledCudaError", 2: "ncclSystemError", 3: "ncclInternalError",
    4: "ncclInvalidArgument", 5: "ncclInvalidUsage", 6: "ncclRemoteError", 7: "ncclInProgress",
    8: "ncclTimeout",
}

NCCL_CONFIG_UNDEF_INT = -(2**31)  # INT_MIN
NCCL_API_MAGIC = 0xCAFEBEEF
NCCL_SPLIT_NOCOLOR = -1


def version_code(major: int, minor: int, patch: int) -> int:
    """nccl.h's ``NCCL_VERSION(X, Y, Z)``: the code ``ncclGetVersion`` returns."""
    if major <= 2 and minor <= 8:
        return major * 1000 + minor * 100 + patch
    return major * 10000 + minor * 100 + patch


def decode_version(code: int) -> tuple[int, int, int]:
    """The (major, minor, patch) of a version code (both encodings, before and after 2.9)."""
    if code < 10000:
        return code // 1000, (code % 1000) // 100, code % 100
    return code // 10000, (code % 10000) // 100, code % 100


#: The oldest NCCL spmd-nccl runs on: non-blocking communicators, ncclCommFinalize, ncclConfig_t.
MIN_VERSION = version_code(2, 14, 0)


# -- the bound functions ----------------------------------------------------------------
@dataclass(frozen=True)
class Function:
    """One exported symbol: its C signature in ctypes terms and the first version that has it."""

    name: str
    restype: Any
    argtypes: tuple[Any, ...]
    since: int = 0  # version code; 0 means every version spmd-nccl supports

    @property
    def required(self) -> bool:
        return self.since <= MIN_VERSION


_P = ctypes.POINTER
FUNCTIONS: tuple[Function, ...] = (
    # ncclResult_t ncclGetVersion(int* version)
    Function("ncclGetVersion", ncclResult_t, (_P(ctypes.c_int),)),
    # ncclResult_t ncclGetUniqueId(ncclUniqueId* uniqueId)
    Function("ncclGetUniqueId", ncclResult_t, (_P(ncclUniqueId),)),
    # ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank)
    Function("ncclCommInitRank", ncclResult_t, (_P(ncclComm_t), ctypes.c_int, ncclUniqueId, ctypes.c_int)),
    # ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank, ncclConfig_t* config)
    Function(
        "ncclCommInitRankConfig", ncclResult_t,
        (_P(ncclComm_t), ctypes.c_int, ncclUniqueId, ctypes.c_int, config_p), version_code(2, 14, 0),
    ),
    # ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm, ncclConfig_t* config)
    Function(
        "ncclCommSplit", ncclResult_t,
        (ncclComm_t, ctypes.c_int, ctypes.c_int, _P(ncclComm_t), config_p), version_code(2, 18, 0),
    ),
    # ncclResult_t ncclCommFinalize(ncclComm_t comm)
    Function("ncclCommFinalize", ncclResult_t, (ncclComm_t,), version_code(2, 14, 0)),
    # ncclResult_t ncclCommDestroy(ncclComm_t comm)
    Function("ncclCommDestroy", ncclResult_t, (ncclComm_t,)),
    # ncclResult_t ncclCommAbort(ncclComm_t comm)
    Function("ncclCommAbort", ncclResult_t, (ncclComm_t,)),
    # ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError)
    Function("ncclCommGetAsyncError", ncclResult_t, (ncclComm_t, _P(ncclResult_t))),
    # const char* ncclGetErrorString(ncclResult_t result)
    Function("ncclGetErrorString", ctypes.c_char_p, (ncclResult_t,)),
    # const char* ncclGetLastError(ncclComm_t comm)
    Function("ncclGetLastError", ctypes.c_char_p, (ncclComm_t,), version_code(2, 13, 0)),
    # ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count,
    #     ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream)
    Function(
        "ncclAllReduce", ncclResult_t,
        (buffer_t, buffer_t, ctypes.c_size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t),
    ),
    # ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count,
    #     ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream)
    Function(
        "ncclBroadcast", ncclResult_t,
        (buffer_t, buffer_t, ctypes.c_size_t, ncclDataType_t, ctypes.c_int, ncclComm_t, cudaStream_t),
    ),
    # ncclResult_t ncclReduce(const void* sendbuff, void* recvbuff, size_t count,
    #     ncclDataType_t datatype, ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream)
    Function(
        "ncclReduce", ncclResult_t,
        (buffer_t, buffer_t, ctypes.c_size_t, ncclDataType_t, ncclRedOp_t, ctypes.c_int, ncclComm_t, cudaStream_t),
    ),
    # ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount,
    #     ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream)
    Function(
        "ncclAllGather", ncclResult_t,
        (buffer_t, buffer_t, ctypes.c_size_t, ncclDataType_t, ncclComm_t, cudaStream_t),
    ),
    # ncclResult_t ncclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount,
    #     ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream)
    Function(
        "ncclReduceScatter", ncclResult_t,
        (buffer_t, buffer_t, ctypes.c_size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t),
    ),
    # ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer,
    #     ncclComm_t comm, cudaStream_t stream)
    Function(
        "ncclSend", ncclResult_t,
        (buffer_t, ctypes.c_size_t, ncclDataType_t, ctypes.c_int, ncclComm_t, cudaStream_t),
    ),
    # ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer,
    #     ncclComm_t comm, cudaStream_t stream)
    Function(
        "ncclRecv", ncclResult_t,
        (buffer_t, ctypes.c_size_t, ncclDataType_t, ctypes.c_int, ncclComm_t, cudaStream_t),
    ),
    # ncclResult_t ncclGroupStart(); ncclResult_t ncclGroupEnd()
    Function("ncclGroupStart", ncclResult_t, ()),
    Function("ncclGroupEnd", ncclResult_t, ()),
)
FUNCTIONS_BY_NAME = {f.name: f for f in FUNCTIONS}


# -- ncclConfig_t -------------------------------------------------------------------------
#: The leading fields of ``ncclConfig_t`` (append-only across versions), each with the
#: version that added it. NCCL copies ``min(config.size, its own sizeof)`` bytes and resets
#: every field newer than ``config.version`` to its default, so a prefix is a valid config.
CONFIG_FIELDS: tuple[tuple[str, Any, int], ...] = (
    ("size", ctypes.c_size_t, 0),
    ("magic", ctypes.c_uint, 0),
    ("version", ctypes.c_uint, 0),
    ("blocking", ctypes.c_int, version_code(2, 14, 0)),
    ("cgaClusterSize", ctypes.c_int, version_code(2, 17, 0)),
    ("minCTAs", ctypes.c_int, version_code(2, 17, 0)),
    ("maxCTAs", ctypes.c_int, version_code(2, 17, 0)),
    ("netName", ctypes.c_char_p, version_code(2, 17, 0)),
    ("splitShare", ctypes.c_int, version_code(2, 18, 0)),
)
_config_types: dict[int, type[ctypes.Structure]] = {}


def config_type(library_version: int) -> type[ctypes.Structure]:
    """The ``ncclConfig_t`` prefix that a library of ``library_version`` understands."""
    fields = tuple((name, ctype) for name, ctype, since in CONFIG_FIELDS if since <= library_version)
    layout = max(since for _, _, since in CONFIG_FIELDS if since <= library_version)
    cls = _config_types.get(layout)
    if cls is None:
        cls = type(f"ncclConfig_v{layout}", (ctypes.Structure,), {"_fields_": list(fields)})
        _config_types[layout] = cls
    return cls


def make_config(library_version: int, **values: Any) -> ctypes.Structure:
    """``NCCL_CONFIG_INITIALIZER`` for the loaded library, with ``values`` applied.

    ``size`` is the end of the last field (not ``sizeof``, whose tail padding would
    land on the next version's first field), ``version`` the layout's version, and
    every user field starts undefined (``NCCL_CONFIG_UNDEF_INT`` / NULL), as in nccl.h.
    """
    if library_version < MIN_VERSION:
        raise ValueError(f"ncclConfig_t needs NCCL >= 2.14, the library is {'.'.join(map(str, decode_version(library_version)))}")
    cls = config_type(library_version)
    config = cls()
    fields: list[tuple[str, Any]] = [(f[0], f[1]) for f in cls._fields_]  # type: ignore[attr-defined]
    names = [name for name, _ in fields]
    last = getattr(cls, names[-1])
    config.size = last.offset + last.size
    config.magic = NCCL_API_MAGIC
    config.version = max(since for name, _, since in CONFIG_FIELDS if name in names)
    for name, ctype in fields:
        if name in ("size", "magic", "version"):
            continue
        setattr(config, name, None if ctype is ctypes.c_char_p else NCCL_CONFIG_UNDEF_INT)
    for name, value in values.items():
        if name not in names or name in ("size", "magic", "version"):
            known = ", ".join(n for n in names if n not in ("size", "magic", "version"))
            raise ValueError(f"ncclConfig_t of NCCL {'.'.join(map(str, decode_version(library_version)))} has no settable field {name!r} (it has: {known})")
        setattr(config, name, value.encode() if isinstance(value, str) else value)
    return config


# -- errors ---------------------------------------------------------------------------------
class NcclLibraryError(RuntimeError):
    """The NCCL library could not be found or loaded (the message says where it looked)."""


# -- discovery ------------------------------------------------------------------------------
#: Where NVIDIA's wheels put libnccl.so.2, as (package, sub-directory): nvidia-nccl-cu12 and
#: nvidia-nccl-cu13 use nvidia/nccl/lib; the CUDA 13 wheel family also uses nvidia/cu13/lib.
WHEEL_LOCATIONS = (("nvidia.nccl", "lib"), ("nvidia", os.path.join("cu13", "lib")), ("nvidia", os.path.join("cu12", "lib")))


def _package_dirs(package: str) -> list[str]:
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    roots = [str(root) for root in spec.submodule_search_locations or []]
    if spec.origin and spec.origin not in ("namespace", "built-in"):
        roots.append(os.path.dirname(spec.origin))
    return roots


def wheel_library() -> str | None:
    """``libnccl.so.2`` of an installed NVIDIA NCCL wheel (``nvidia-nccl-cu12``: ``nvidia/nccl/lib``), if any.

    Located through the installed ``nvidia`` packages (``importlib.util.find_spec``),
    wherever pip put them: no path is hard-coded.
    """
    for package, sub in WHEEL_LOCATIONS:
        for root in _package_dirs(package):
            candidate = os.path.join(root, sub, SONAME)
            if os.path.isfile(candidate):
                return candidate
    return None


def candidates() -> list[tuple[str, str]]:
    """Where the library may come from, in order: (path or soname, how it was found).

    An explicit ``SPMD_NCCL_LIBRARY`` is the only candidate when set, so a typo in it
    is an error rather than a silent fall-back to another NCCL.
    """
    explicit = os.environ.get(ENV_VAR, "").strip()
    if explicit:
        return [(explicit, ENV_VAR)]
    found: list[tuple[str, str]] = []
    wheel = wheel_library()
    if wheel is not None:
        found.append((wheel, WHEEL_SOURCE))
    found.append((SONAME, "the system's dynamic loader"))
    return found


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def _loaded_file(cdll: ctypes.CDLL, fallback: str) -> str:
    """The file the loader actually mapped (``dladdr`` on one of its symbols)."""
    try:
        dladdr = ctypes.CDLL(None).dladdr
        dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
        dladdr.restype = ctypes.c_int
        info = _DlInfo()
        address = ctypes.cast(cdll.ncclGetVersion, ctypes.c_void_p)
        if dladdr(address, ctypes.byref(info)) and info.dli_fname:
            return os.path.realpath(info.dli_fname.decode())
    except (AttributeError, OSError):
        pass
    return os.path.realpath(fallback) if os.sep in fallback else fallback


# -- the library ----------------------------------------------------------------------------
class NcclLibrary:
    """One loaded ``libnccl.so.2`` with every function of ``FUNCTIONS`` bound.

    ``functions[name]`` is the bound ctypes function (None for an optional one the
    library is too old to have); the same functions are attributes (``lib.ncclAllReduce``).
    """

    # The bound functions, one per entry of FUNCTIONS (None where an optional one is missing).
    ncclGetVersion: Any
    ncclGetUniqueId: Any
    ncclCommInitRank: Any
    ncclCommInitRankConfig: Any
    ncclCommSplit: Any
    ncclCommFinalize: Any
    ncclCommDestroy: Any
    ncclCommAbort: Any
    ncclCommGetAsyncError: Any
    ncclGetErrorString: Any
    ncclGetLastError: Any
    ncclAllReduce: Any
    ncclBroadcast: Any
    ncclReduce: Any
    ncclAllGather: Any
    ncclReduceScatter: Any
    ncclSend: Any
    ncclRecv: Any
    ncclGroupStart: Any
    ncclGroupEnd: Any

    def __init__(self, path: str, source: str) -> None:
        self.requested = path
        self.source = source
        try:
            self.cdll = ctypes.CDLL(path)
        except OSError as error:
            raise NcclLibraryError(f"could not load {path} (from {source}): {error}") from error
        self.path = _loaded_file(self.cdll, path)
        self.functions: dict[str, Callable[..., Any] | None] = {}
        missing = []
        for fn in FUNCTIONS:
            bound: Any
            try:
                bound = self.cdll[fn.name]  # a fresh function object: its types are ours alone
            except AttributeError:
                bound = None
                if fn.required:
                    missing.append(fn.name)
            else:
                bound.restype = fn.restype
                bound.argtypes = list(fn.argtypes)
            self.functions[fn.name] = bound
            setattr(self, fn.name, bound)
        version = ctypes.c_int()
        if self.functions["ncclGetVersion"] is None:
            raise NcclLibraryError(f"{self.path} (from {source}) has no ncclGetVersion: it is not an NCCL library")
        result = self.ncclGetVersion(ctypes.byref(version))
        if result != ncclSuccess:
            raise NcclLibraryError(f"ncclGetVersion failed in {self.path}: {self.error_string(result)}")
        self.version = version.value
        if missing:
            raise NcclLibraryError(
                f"{self.path} (NCCL {self.version_string}) lacks {', '.join(missing)}; spmd-nccl needs NCCL >= 2.14: "
                f"{INSTALL_HINT}, or point {ENV_VAR} at a newer libnccl.so.2"
            )

    @property
    def version_tuple(self) -> tuple[int, int, int]:
        return decode_version(self.version)

    @property
    def version_string(self) -> str:
        return ".".join(map(str, self.version_tuple))

    def has(self, name: str) -> bool:
        return self.functions.get(name) is not None

    def at_least(self, major: int, minor: int, patch: int = 0) -> bool:
        return self.version >= version_code(major, minor, patch)

    # -- errors ---------------------------------------------------------------------------
    def error_string(self, result: int) -> str:
        """``ncclGetErrorString(result)`` plus the result's name."""
        text = self.ncclGetErrorString(result)
        name = RESULT_NAMES.get(result, f"ncclResult {result}")
        return f"{name}: {text.decode(errors='replace') if text else 'unknown'}"

    def last_error(self, comm: Any = None) -> str:
        """``ncclGetLastError(comm)`` (the last error's detail, often naming the failing call)."""
        if not self.has("ncclGetLastError"):
            return ""
        text = self.ncclGetLastError(comm)
        return text.decode(errors="replace").strip() if text else ""

    def describe(self, result: int, comm: Any = None) -> str:
        """The error string and, where NCCL has one, the last-error detail."""
        detail = self.last_error(comm)
        return f"{self.error_string(result)}" + (f" ({detail})" if detail else "")

    # -- small helpers ----------------------------------------------------------------------
    def unique_id(self) -> ncclUniqueId:
        """A fresh ``ncclUniqueId`` (works without a GPU: it only opens the bootstrap socket)."""
        uid = ncclUniqueId()
        result = self.ncclGetUniqueId(ctypes.byref(uid))
        if result != ncclSuccess:
            raise NcclLibraryError(f"ncclGetUniqueId failed: {self.describe(result)}")
        return uid

    def config(self, **values: Any) -> ctypes.Structure:
        """An ``ncclConfig_t`` for this library (see ``make_config``)."""
        return make_config(self.version, **values)

    def __repr__(self) -> str:
        return f"<NcclLibrary {self.version_string} from {self.path}>"


_cache: dict[str, NcclLibrary] = {}
_lock = threading.Lock()


def load() -> NcclLibrary:
    """The NCCL library, from the first candidate that loads (cached); NcclLibraryError if none does."""
    tried = []
    for path, source in candidates():
        with _lock:
            cached = _cache.get(path)
        if cached is not None:
            return cached
        if source == ENV_VAR and os.sep in path and not os.path.exists(path):
            raise NcclLibraryError(
                f"{ENV_VAR}={path} does not exist; point it at a libnccl.so.2 file or unset it "
                f"to use the nvidia-nccl-cu12 wheel ({INSTALL_HINT})"
            )
        try:
            library = NcclLibrary(path, source)
        except NcclLibraryError as error:
            if source == ENV_VAR:
                raise NcclLibraryError(f"{ENV_VAR}={path} is unusable: {error}") from error
            tried.append(str(error))
            continue
        with _lock:
            library = _cache.setdefault(path, library)
        return library
    raise NcclLibraryError(f"no NCCL library found ({'; '.join(tried)}); {INSTALL_HINT}")


def clear_cache() -> None:
    """Forget loaded libraries (tests; the shared objects stay mapped)."""
    with _lock:
        _cache.clear()
