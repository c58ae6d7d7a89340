"""Launch the ranks of each backend's measurement and collect rank 0's results.

Each backend gets its own set of processes (native stacks such as MPI's and
UCX's must not share one process). A backend whose spec carries ``launch``
(a command prefix such as ``("mpiexec", "-n", "{nproc}")``) is started
through it; the rest as plain processes with torchrun's variables.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from spmd.bench.launch import launch_local, rendezvous_env
from spmd.comm.registry import backends


def installed_runnable(device: str = "cpu") -> list[str]:
    """Backends for ``device`` that are usable here, highest priority first."""
    entries = [e for e in backends().entries() if device in e.spec.devices and e.spec.unavailable_reason() is None]
    return [e.spec.name for e in sorted(entries, key=lambda e: (-e.spec.priority, e.spec.name))]


def run_backend(backend: str, nproc: int, ops: list[str], sizes: list[int], budget: float, vs_raw: bool, progress: bool, timeout: float,
                threads: int | None = 1) -> list[dict[str, Any]]:
    """Start ``nproc`` ranks for ``backend`` and return rank 0's rows.

    ``threads``: torch threads per rank (``OMP_NUM_THREADS`` and ``torch.set_num_threads``); None
    leaves both at torch's default (a thread per core), as under a launcher that sets neither.
    """
    spec = backends().get(backend).spec
    reason = spec.unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"backend {backend!r} cannot run here: {reason}")
    with tempfile.TemporaryDirectory(prefix="spmd-bench-") as tmp:
        out = Path(tmp) / "results.json"
        worker = [sys.executable, "-m", "spmd.bench.worker", "--backend", backend, "--ops", ",".join(ops),
                  "--sizes", ",".join(map(str, sizes)), "--budget", str(budget), "--out", str(out),
                  "--threads", "default" if threads is None else str(threads)]
        if vs_raw:
            worker.append("--vs-raw")
        if progress:
            worker.append("--progress")
        env = rendezvous_env(omp_num_threads=None if threads is None else str(threads))
        launch = getattr(spec, "launch", None)
        launcher = [part.format(nproc=nproc) for part in launch] if launch else None
        try:
            codes = launch_local(worker, nproc, launcher=launcher, env=env, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"backend {backend!r}: the benchmark did not finish within {timeout:.0f} s") from None
        if any(codes) or not out.exists():
            raise RuntimeError(f"backend {backend!r}: benchmark ranks failed (exit codes {codes})")
        return json.loads(out.read_text())
