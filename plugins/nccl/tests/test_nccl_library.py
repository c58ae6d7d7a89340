"""The NCCL library itself, on a machine without a GPU: discovery, version, errors, unique ids, bindings."""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("spmd_nccl", reason="spmd-nccl is not installed (pip install -e plugins/nccl)")

from spmd_nccl import library  # noqa: E402


def _wheel_or_skip() -> str:
    path = library.wheel_library()
    if path is None:
        pytest.skip("the nvidia-nccl-cu12 wheel is not installed (pip install nvidia-nccl-cu12)")
    return path


@pytest.fixture
def lib(monkeypatch: pytest.MonkeyPatch) -> library.NcclLibrary:
    monkeypatch.delenv(library.ENV_VAR, raising=False)
    try:
        return library.load()
    except library.NcclLibraryError as error:
        pytest.skip(f"no NCCL library here: {error}")


@pytest.fixture
def header() -> str:
    """nccl.h of the installed wheel (the declarations the bindings must match)."""
    path = os.path.join(os.path.dirname(os.path.dirname(_wheel_or_skip())), "include", "nccl.h")
    if not os.path.isfile(path):
        pytest.skip(f"the wheel ships no nccl.h at {path}")
    with open(path) as f:
        return f.read()


# -- discovery -------------------------------------------------------------------------------
def test_importing_the_plugin_loads_no_library() -> None:
    code = (
        "import spmd_nccl, spmd_nccl.library, sys\n"
        "maps = open('/proc/self/maps').read()\n"
        "assert 'libnccl' not in maps, 'libnccl mapped at import'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_bogus_env_path_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(library.ENV_VAR, "/nonexistent/dir/libnccl.so.2")
    with pytest.raises(library.NcclLibraryError, match=r"SPMD_NCCL_LIBRARY=/nonexistent/dir/libnccl\.so\.2 does not exist"):
        library.load()
    # and it never falls back silently to another NCCL
    assert library.candidates() == [("/nonexistent/dir/libnccl.so.2", library.ENV_VAR)]


def test_env_path_to_a_non_nccl_library_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    libc = ctypes.util.find_library("c")
    if libc is None:
        pytest.skip("no libc found to stand in for a wrong library")
    monkeypatch.setenv(library.ENV_VAR, libc)
    with pytest.raises(library.NcclLibraryError, match="is unusable: .*not an NCCL library"):
        library.load()


def test_env_path_to_the_real_library_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    path = _wheel_or_skip()
    library.clear_cache()
    monkeypatch.setenv(library.ENV_VAR, path)
    loaded = library.load()
    assert loaded.source == library.ENV_VAR
    assert loaded.path == os.path.realpath(path)
    library.clear_cache()


def test_wheel_library_is_found_through_the_installed_package(lib: library.NcclLibrary) -> None:
    path = _wheel_or_skip()
    assert path.endswith(os.path.join("lib", "libnccl.so.2"))
    spec = importlib.util.find_spec("nvidia")
    assert any(path.startswith(str(root)) for root in spec.submodule_search_locations)
    assert lib.source == library.WHEEL_SOURCE == "the nvidia-nccl wheel"
    assert lib.path == os.path.realpath(path)  # what dladdr says was mapped


def test_without_wheel_and_soname_the_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(library.ENV_VAR, raising=False)
    monkeypatch.setattr(library, "wheel_library", lambda: None)
    monkeypatch.setattr(library, "SONAME", "libnccl-that-does-not-exist.so.2")
    library.clear_cache()
    assert library.candidates() == [("libnccl-that-does-not-exist.so.2", "the system's dynamic loader")]
    with pytest.raises(library.NcclLibraryError, match=r"no NCCL library found .*pip install nvidia-nccl-cu12"):
        library.load()
    library.clear_cache()


# -- version and errors ------------------------------------------------------------------------
def test_version_codes_round_trip() -> None:
    assert library.version_code(2, 8, 4) == 2804  # the pre-2.9 encoding
    assert library.version_code(2, 32, 3) == 23203
    assert library.decode_version(2804) == (2, 8, 4)
    assert library.decode_version(23203) == (2, 32, 3)
    assert library.MIN_VERSION == 21400


def test_version_is_the_wheels(lib: library.NcclLibrary) -> None:
    assert lib.version >= library.MIN_VERSION
    if lib.source == library.WHEEL_SOURCE:
        versions = []
        for dist in ("nvidia-nccl-cu12", "nvidia-nccl-cu13"):
            try:
                versions.append(importlib.metadata.version(dist))
            except importlib.metadata.PackageNotFoundError:
                pass
        assert lib.version_string in versions


def test_error_strings_come_from_the_library(lib: library.NcclLibrary) -> None:
    assert lib.error_string(0) == "ncclSuccess: no error"
    for code, name in library.RESULT_NAMES.items():
        text = lib.error_string(code)
        assert text.startswith(name + ": ") and len(text) > len(name) + 3
    assert "invalid argument" in lib.error_string(library.ncclInvalidArgument)


def test_a_failed_init_without_cuda_reports_the_last_error(lib: library.NcclLibrary) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: ncclCommInitRank would succeed")
    comm = library.ncclComm_t()
    result = lib.ncclCommInitRank(ctypes.byref(comm), 1, lib.unique_id(), 0)
    assert result == library.ncclUnhandledCudaError
    assert comm.value is None
    assert "cuda" in lib.last_error().lower()
    assert lib.describe(result).startswith("ncclUnhandledCudaError: unhandled cuda error")


def test_unique_id_works_without_a_gpu(lib: library.NcclLibrary) -> None:
    first, second = lib.unique_id(), lib.unique_id()
    assert len(bytes(first)) == library.NCCL_UNIQUE_ID_BYTES == 128
    assert bytes(first) != bytes(128)
    assert bytes(first) != bytes(second)


# -- bindings -----------------------------------------------------------------------------------
def test_every_bound_symbol_exists_with_its_declared_types(lib: library.NcclLibrary) -> None:
    for fn in library.FUNCTIONS:
        bound = lib.functions[fn.name]
        if lib.version < fn.since:
            assert bound is None
            continue
        assert bound is not None, f"{fn.name} is missing from {lib.path}"
        assert hasattr(lib.cdll, fn.name)
        assert bound.restype is fn.restype, fn.name
        assert tuple(bound.argtypes) == fn.argtypes, fn.name
        assert getattr(lib, fn.name) is bound
    required = {"ncclGetVersion", "ncclGetUniqueId", "ncclCommInitRank", "ncclCommInitRankConfig", "ncclCommSplit",
                "ncclCommAbort", "ncclCommDestroy", "ncclCommFinalize", "ncclCommGetAsyncError", "ncclGetErrorString",
                "ncclGetLastError", "ncclAllReduce", "ncclBroadcast", "ncclReduce", "ncclAllGather", "ncclReduceScatter",
                "ncclSend", "ncclRecv", "ncclGroupStart", "ncclGroupEnd"}
    assert required <= set(library.FUNCTIONS_BY_NAME)


_C_TYPES = {
    "int": ctypes.c_int,
    "int*": ctypes.POINTER(ctypes.c_int),
    "size_t": ctypes.c_size_t,
    "void*": ctypes.c_void_p,
    "const void*": ctypes.c_void_p,
    "ncclComm_t": ctypes.c_void_p,
    "ncclComm_t*": ctypes.POINTER(ctypes.c_void_p),
    "ncclUniqueId": library.ncclUniqueId,
    "ncclUniqueId*": ctypes.POINTER(library.ncclUniqueId),
    "ncclConfig_t*": ctypes.c_void_p,
    "ncclResult_t": ctypes.c_int,
    "ncclResult_t*": ctypes.POINTER(ctypes.c_int),
    "ncclDataType_t": ctypes.c_int,
    "ncclRedOp_t": ctypes.c_int,
    "cudaStream_t": ctypes.c_void_p,
    "const char*": ctypes.c_char_p,
}


def _prototypes(header: str) -> dict[str, tuple[str, list[str]]]:
    found = {}
    for match in re.finditer(r"^(ncclResult_t|const char\*)\s+(nccl\w+)\s*\(([^)]*)\);", header, re.M):
        params = " ".join(match.group(3).split())
        types = []
        for param in [p.strip() for p in params.split(",") if p.strip()]:
            param = param.replace(" *", "* ").replace("const ncclComm_t", "ncclComm_t")
            types.append(" ".join(param.split()[:-1]) if len(param.split()) > 1 else param)
        found[match.group(2)] = (match.group(1), types)
    return found


def test_bindings_match_the_headers_prototypes(header: str) -> None:
    prototypes = _prototypes(header)
    for fn in library.FUNCTIONS:
        assert fn.name in prototypes, f"{fn.name} is not declared in nccl.h"
        restype, params = prototypes[fn.name]
        assert _C_TYPES[restype] is fn.restype, f"{fn.name} returns {restype}"
        declared = tuple(_C_TYPES[p] for p in params)
        assert len(declared) == len(fn.argtypes), f"{fn.name}: nccl.h has {params}"
        for i, (want, got) in enumerate(zip(declared, fn.argtypes)):
            assert want is got or (want == got), f"{fn.name} argument {i} ({params[i]}): bound as {got}"


def _header_config_fields(header: str) -> list[tuple[str, str]]:
    body = re.search(r"typedef struct ncclConfig_v\d+ \{(.*?)\} ncclConfig_t;", header, re.S)
    assert body, "no ncclConfig_t in nccl.h"
    fields = []
    for line in body.group(1).splitlines():
        line = line.split("/*")[0].strip()
        if line.endswith(";"):
            *kind, name = re.sub(r"\s*\*\s*", "* ", line[:-1]).split()
            fields.append((name, " ".join(kind)))
    return fields


def test_config_prefix_matches_the_headers_struct(header: str) -> None:
    ctype = {"size_t": ctypes.c_size_t, "unsigned int": ctypes.c_uint, "int": ctypes.c_int, "const char*": ctypes.c_char_p}
    fields = _header_config_fields(header)
    assert [name for name, _ in fields[:len(library.CONFIG_FIELDS)]] == [name for name, _, _ in library.CONFIG_FIELDS]
    full = type("HeaderConfig", (ctypes.Structure,), {"_fields_": [(n, ctype.get(k, ctypes.c_int)) for n, k in fields]})
    ours = library.config_type(library.version_code(2, 32, 3))
    for name, _ in ours._fields_:
        assert getattr(ours, name).offset == getattr(full, name).offset, name
        assert getattr(ours, name).size == getattr(full, name).size, name


def test_config_is_the_initializer_for_each_layout() -> None:
    config = library.make_config(library.version_code(2, 32, 3), blocking=0)
    assert config.magic == library.NCCL_API_MAGIC
    assert config.version == library.version_code(2, 18, 0)
    assert config.size == type(config).splitShare.offset + 4  # the end of the last field, no tail padding
    assert config.blocking == 0
    assert config.splitShare == config.minCTAs == library.NCCL_CONFIG_UNDEF_INT
    assert config.netName is None
    older = library.make_config(library.version_code(2, 15, 0), blocking=1)
    assert [n for n, _ in older._fields_] == ["size", "magic", "version", "blocking"]
    assert older.size == 20 and older.version == library.version_code(2, 14, 0)
    with pytest.raises(ValueError, match="no settable field 'splitShare'"):
        library.make_config(library.version_code(2, 15, 0), splitShare=1)
    with pytest.raises(ValueError, match="NCCL >= 2.14"):
        library.make_config(library.version_code(2, 12, 0))
