"""spmd-ucc is installed and listed, loads without loading UCX, explains itself, honours wait(timeout).

The pytest process never imports ucxx: the MPI wheels bundle a UCX under the
same library names, and both in one process fail (see spmd_ucc.probe). What
needs UCX runs in World worker processes or in subprocesses.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

import spmd
from spmd.comm.registry import backends
from spmd_ucc import probe

needs_ucxx = pytest.mark.skipif(probe.ucxx_missing() is not None, reason=f"ucc backend not usable here: {probe.ucxx_missing()}")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


# -- the plugin ------------------------------------------------------------------------
def test_plugin_is_installed_with_a_cpu_backend():
    entry = backends().get("ucc")
    assert entry.plugin == "ucc"
    assert entry.spec.devices == ("cpu",)  # CUDA tensors are not supported (yet): see README
    assert entry.spec.priority < backends().get("gloo").spec.priority
    assert "ucxx" in entry.spec.description or "UCX" in entry.spec.description


def test_the_spec_reads_its_capabilities_off_the_class_without_importing_ucxx():
    from spmd_ucc.backend import UccBackend  # imports no ucxx either

    spec = backends().get("ucc").spec
    assert spec.backend_type() is UccBackend
    assert spec.native_ops() == UccBackend.native_ops() and "all_reduce" in spec.native_ops()
    assert "ucxx" not in sys.modules


def test_spmd_plugins_lists_it():
    out = subprocess.run([sys.executable, "-m", "spmd", "plugins"], capture_output=True, text=True, check=True).stdout
    assert "spmd-ucc" in out and "ucc (cpu)" in out


def test_loading_plugins_and_doctor_do_not_import_ucxx():
    done = _run(
        "import sys, spmd\n"
        "from spmd.comm.registry import backends\n"
        "spec = backends().get('ucc').spec\n"
        "print(spec.unavailable_reason(), spec.description)\n"
        "import spmd_ucc.backend\n"
        "assert 'ucxx' not in sys.modules, 'ucxx was imported'\n"
        "assert not any(m.startswith('ucxx') for m in sys.modules)\n"
    )
    assert done.returncode == 0, done.stderr
    doctor = subprocess.run([sys.executable, "-m", "spmd", "doctor"], capture_output=True, text=True)
    assert "ucc [cpu] from ucc" in doctor.stdout
    if probe.ucxx_missing() is None:
        # version and transports, the latter from `ucx_info -d` in a subprocess (UCX is not loaded)
        assert "UCX 1." in doctor.stdout and "transports found: " in doctor.stdout, doctor.stdout


def test_without_ucxx_the_reason_says_what_to_install():
    done = _run(
        "import sys; sys.modules['ucxx'] = None\n"
        "from spmd.comm.registry import backends\n"
        "print(backends().get('ucc').spec.unavailable_reason())\n"
    )
    assert done.returncode == 0, done.stderr
    assert "pip install" in done.stdout and "plugins/ucc[ucxx]" in done.stdout


def test_with_mpi_loaded_the_reason_names_the_clash():
    done = _run(
        "import sys, types; sys.modules['mpi4py.MPI'] = types.ModuleType('mpi4py.MPI')\n"
        "from spmd_ucc import _available\n"
        "print(_available())\n"
    )
    assert done.returncode == 0, done.stderr
    assert "mpi4py.MPI" in done.stdout and "clashes" in done.stdout


def test_ucx_defaults_yield_to_the_environment(monkeypatch):
    monkeypatch.delenv("UCX_MM_ERROR_HANDLING", raising=False)
    monkeypatch.setenv("UCX_CMA_MEMORY_INVALIDATE", "n")
    config = probe.ucx_config({"ucx_tls": "tcp"})
    assert config == {"MM_ERROR_HANDLING": "y", "TLS": "tcp"}


@needs_ucxx
def test_probe_lists_transports():
    done = subprocess.run([sys.executable, "-m", "spmd_ucc.probe"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "transports found" in done.stdout and "UCX" in done.stdout
    assert "self/memory" in done.stdout  # UCX's loopback transport exists everywhere


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: checks that a CUDA tensor on a ucc group fails with a clear error (spmd-ucc is CPU-only)")
def test_cuda_tensors_are_refused_clearly(spmd_world):
    world = spmd_world(2, "ucc")
    world.run(_cuda_refused)


def _cuda_refused() -> None:
    t = torch.ones(4, device="cuda")
    with pytest.raises(spmd.SpmdError, match="cuda"):
        spmd.all_reduce(t)


# -- behaviour on real ranks -------------------------------------------------------------
def _wait_timeout_is_honoured() -> float:
    """Rank 0 waits 0.5 s for a message that rank 1 sends only after that; then it arrives."""
    g = spmd.comm.state.get_state().world
    if g.rank == 0:
        got = torch.zeros(4)
        work = spmd.irecv(got, src=1, tag=11)
        start = time.monotonic()
        with pytest.raises(spmd.CollectiveTimeoutError):
            work.wait(timeout=0.5)
        elapsed = time.monotonic() - start
        spmd.barrier()
        work.wait()  # the op itself was not cancelled by the timed-out wait
        assert torch.equal(got, torch.full((4,), 5.0))
        return elapsed
    spmd.barrier()
    spmd.send(torch.full((4,), 5.0), dst=0, tag=11)
    return 0.0


@needs_ucxx
def test_wait_timeout_is_honoured(spmd_world):
    elapsed = spmd_world(2, "ucc").run(_wait_timeout_is_honoured)[0]
    assert 0.45 <= elapsed < 3.0


def _concurrent_groups_and_async_ops() -> list[float]:
    """Async all-reduces on two groups at once, issued in opposite orders, some large (ring)."""
    n, r = spmd.get_world_size(), spmd.get_rank()
    world = spmd.comm.state.get_state().world
    other = spmd.new_group(list(range(n)))
    works, tensors = [], []
    sizes = [1, 70001, 3, 1 << 19, 5]
    order = [(world, s) for s in sizes] + [(other, s) for s in sizes]
    for group, size in order:
        t = torch.full((size,), float(r + 1))
        tensors.append((t, group))
        works.append(spmd.all_reduce(t, group=group, async_op=True))
    for w in reversed(works):  # wait in the reverse order: progress must not depend on it
        w.wait()
    expected = n * (n + 1) / 2
    for t, _ in tensors:
        assert torch.all(t == expected), t[:4]
    # done-callbacks fire with nobody waiting (the background progress thread)
    fired = []
    t = torch.ones(1 << 16)
    work = spmd.all_reduce(t, async_op=True)
    work.get_future().then(lambda f: fired.append(time.monotonic()))
    deadline = time.monotonic() + 10
    while not fired and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fired, "callback never ran without a waiter"
    assert torch.all(t == n)
    return [float(len(fired))]


@needs_ucxx
@pytest.mark.parametrize("world_size", [2, 3])
def test_concurrent_groups_async_ops_and_callbacks(spmd_world, world_size):
    spmd_world(world_size, "ucc").run(_concurrent_groups_and_async_ops)


def _ring_sizes_and_dtypes() -> None:
    """The ring all-reduce on uneven chunk and segment boundaries, every reduce op of a few dtypes."""
    from spmd.testing.conformance.data import check_reduced, expected_reduce, make_input, valid_ops

    g = spmd.comm.state.get_state().world
    for numel in (g.size, 65537, (1 << 20) + 13, (3 << 20) + 1):
        for dtype in (torch.float32, torch.int64, torch.bfloat16, torch.bool):
            for op in valid_ops(dtype)[:3]:
                key = f"ring/{numel}/{dtype}/{op.name}"
                inputs = [make_input(i, key, (numel,), dtype, op) for i in range(g.size)]
                t = inputs[g.rank].clone()
                spmd.all_reduce(t, op)
                check_reduced(t, expected_reduce(inputs, op), key)


@needs_ucxx
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_all_reduce_on_uneven_sizes(spmd_world, world_size):
    spmd_world(world_size, "ucc").run(_ring_sizes_and_dtypes, timeout=300)


def _ddp_matches_a_local_reference() -> str:
    """spmd DDP over ucc, small buckets (several async all-reduces in flight during backward)."""
    import copy

    from torch import nn

    from spmd.parallel import DistributedDataParallel as DDP

    n, r = spmd.get_world_size(), spmd.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    reference = copy.deepcopy(model)
    ddp = DDP(model, bucket_cap_mb=0.005)
    for step in range(4):
        inputs = [torch.randn(16, 8, generator=torch.Generator().manual_seed(100 * step + i)) for i in range(n)]
        ddp(inputs[r]).square().mean().backward()
        (sum(reference(x).square().mean() for x in inputs) / n).backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
            p.grad = None
            q.grad = None
    return spmd.get_backend()


@needs_ucxx
def test_ddp_over_ucc(spmd_world):
    assert spmd_world(2, "ucc").run(_ddp_matches_a_local_reference, timeout=120) == ["ucc", "ucc"]


def _all_reduce_sizes() -> dict:
    n = spmd.get_world_size()
    for numel in (1, 1000, (3 << 20) + 5):
        t = torch.ones(numel)
        spmd.all_reduce(t)
        assert torch.all(t == n)
    engine = spmd.comm.state.get_state().world.backend("cpu").engine
    return dict(engine.config)


@needs_ucxx
def test_tcp_only_through_ucx_tls():
    """UCX's own variable picks the transport: everything over TCP (as across hosts) still works."""
    from spmd.testing.world import World

    world = World(2, "ucc", env={"UCX_TLS": "tcp,self"})
    try:
        configs = world.run(_all_reduce_sizes, timeout=120)
    finally:
        world.close()
    assert configs[0]["MM_ERROR_HANDLING"] == "y"
