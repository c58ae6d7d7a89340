"""The plugin as spmd sees it: its BackendSpec, `spmd doctor`, and clear errors where CUDA is absent."""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta

import pytest
import torch

pytest.importorskip("spmd_nccl", reason="spmd-nccl is not installed (pip install -e plugins/nccl)")

import torch.distributed as tdist  # noqa: E402

import spmd  # noqa: E402
import spmd_nccl  # noqa: E402
from spmd.comm.backend import COLLECTIVE_OPS  # noqa: E402
from spmd.comm.registry import backends  # noqa: E402
from spmd.errors import BackendUnavailableError  # noqa: E402
from spmd_nccl import library  # noqa: E402
from spmd_nccl.backend import (  # noqa: E402
    NcclBackend,
    allow_queries_during_other_threads_captures,
    cuda_unavailable_reason,
)

NO_CUDA = not torch.cuda.is_available()


def test_the_spec() -> None:
    entry = backends().get("nccl")
    spec = entry.spec
    assert entry.plugin == "nccl"
    assert spec.devices == ("cuda",)
    assert spec.priority == 50
    assert spec.priority > max(e.spec.priority for e in backends().entries() if e.spec.name != "nccl")
    assert spec.backend_type() is NcclBackend
    assert spec.native_ops() == frozenset(COLLECTIVE_OPS)  # every collective is NCCL's own
    assert NcclBackend.supports_avg is True
    assert spec.description.startswith("NVIDIA NCCL through ctypes (no build step): NCCL ")


@pytest.mark.skipif(not NO_CUDA, reason="a CUDA device is visible here")
def test_unavailable_reason_names_the_library_and_the_missing_gpu() -> None:
    lib = library.load()
    reason = backends().get("nccl").spec.unavailable_reason()
    assert reason is not None
    assert f"NCCL {lib.version_string} loaded from {lib.path}" in reason
    assert "no CUDA device is visible" in reason
    if torch.version.cuda is None:
        assert "CPU-only build" in reason and "install a CUDA build of torch" in reason


def test_unavailable_reason_says_what_to_install_without_a_library(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(library.ENV_VAR, "/nowhere/libnccl.so.2")
    reason = spmd_nccl._available()
    assert reason is not None
    assert "SPMD_NCCL_LIBRARY=/nowhere/libnccl.so.2 does not exist" in reason
    assert "pip install -e plugins/nccl" in reason and "spmd[nccl]" in reason


@pytest.mark.skipif(not NO_CUDA, reason="a CUDA device is visible here")
def test_init_with_nccl_fails_clearly_without_cuda() -> None:
    with pytest.raises(BackendUnavailableError, match=r"backend 'nccl' \(plugin 'nccl'\) cannot run here: NCCL .* no CUDA device is visible"):
        spmd.init("nccl", store=tdist.HashStore(), rank=0, world_size=1)
    assert not spmd.is_initialized()


@pytest.mark.skipif(not NO_CUDA, reason="a CUDA device is visible here")
def test_a_device_map_naming_nccl_still_runs_cpu_work_without_cuda() -> None:
    """Per-device backends are checked on first use of their device, so the CPU half works."""
    spmd.init("cpu:gloo,cuda:nccl", store=tdist.HashStore(), rank=0, world_size=1)
    try:
        t = torch.ones(2)
        spmd.all_reduce(t)
        assert t.tolist() == [1.0, 1.0]
        assert spmd.get_backend(device="cuda") == "nccl"
    finally:
        spmd.destroy_process_group()


@pytest.mark.skipif(not NO_CUDA, reason="a CUDA device is visible here")
def test_init_picks_no_cuda_backend_without_cuda() -> None:
    with pytest.raises(BackendUnavailableError, match="no usable backend for device 'cuda' .*nccl: NCCL"):
        backends().for_device("cuda")


@pytest.mark.skipif(not NO_CUDA, reason="a CUDA device is visible here")
def test_the_factory_refuses_without_cuda() -> None:
    ctx = spmd.BackendContext(rank=0, size=1, store=tdist.HashStore(), timeout=timedelta(seconds=5), group_name="world", device_type="cuda")
    with pytest.raises(BackendUnavailableError, match="spmd-nccl: NCCL .* loaded from .*, but no CUDA device is visible"):
        NcclBackend(ctx)
    assert cuda_unavailable_reason() is not None


def test_doctor_reports_nccl() -> None:
    out = subprocess.run([sys.executable, "-m", "spmd", "doctor"], capture_output=True, text=True, timeout=120)
    assert "+ nccl (spmd-nccl 0.1.0): loaded" in out.stdout, out.stdout + out.stderr
    line = next(line for line in out.stdout.splitlines() if line.strip().startswith(("+ nccl [cuda]", "x nccl [cuda]")))
    assert "priority 50" in line
    if NO_CUDA:
        assert "NOT usable: NCCL 2." in line and "no CUDA device is visible" in line


def test_plugins_lists_nccl() -> None:
    out = subprocess.run([sys.executable, "-m", "spmd", "plugins"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "nccl  [plugin] spmd-nccl 0.1.0  loaded" in out.stdout
    assert "backends: nccl (cuda)" in out.stdout


def test_capture_mode_switch_is_made_once_per_thread_and_thread_local(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each background thread asks the CUDA runtime for the thread-local capture mode exactly once."""
    import ctypes
    import threading

    from spmd_nccl import cuda

    modes: list[tuple[str, int]] = []

    def exchange(mode: ctypes._Pointer) -> int:  # stands in for cudaThreadExchangeStreamCaptureMode
        modes.append((threading.current_thread().name, mode._obj.value))
        return 0

    monkeypatch.setattr(cuda, "_capture_mode_exchange", lambda: exchange)

    def twice() -> None:
        allow_queries_during_other_threads_captures()
        allow_queries_during_other_threads_captures()

    for name in ("a", "b"):
        thread = threading.Thread(target=twice, name=name)
        thread.start()
        thread.join()
    assert modes == [("a", 1), ("b", 1)]  # 1 = cudaStreamCaptureModeThreadLocal, once per thread

    monkeypatch.setattr(cuda, "_capture_mode_exchange", lambda: None)  # no CUDA runtime loaded
    thread = threading.Thread(target=twice)
    thread.start()
    thread.join()
    assert len(modes) == 2
