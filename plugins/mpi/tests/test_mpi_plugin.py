"""The spmd-mpi plugin: installation, discovery without mpi4py, launcher checks, real MPI worlds."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import mpi_helpers
import pytest
from mpi_launch import MPIEXEC, SKIP_REASON

import spmd
from spmd.comm.backend import COLLECTIVE_OPS
from spmd.comm.registry import backends
from spmd.testing import RankFailure, World
from spmd_mpi import probe

needs_mpi = pytest.mark.skipif(MPIEXEC is None, reason=f"needs mpi4py and its mpiexec: {SKIP_REASON}")


def _run(code: str, env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", *probe.MPI_RANK_VARS, *probe.MPI_SIZE_VARS)}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=full_env, check=check, timeout=120)


# -- installation and discovery -------------------------------------------------------------
def test_plugin_is_installed_with_every_collective_native():
    from spmd.plugins import manager

    info = manager().infos["mpi"]
    assert info.distribution == "spmd-mpi" and info.loaded
    spec = backends().get("mpi").spec
    assert spec.devices == ("cpu",)
    # outside mpiexec the CPU default is spmd-shm on one host, Gloo across hosts: both rank above MPI there
    assert spec.priority < backends().get("gloo").spec.priority < backends().get("shm").spec.priority
    assert spec.native_ops() == frozenset(COLLECTIVE_OPS)


def test_mpi_is_the_default_only_under_mpiexec():
    """One rule (the highest-priority usable backend) gives shm (one host) in a plain process and MPI under mpiexec."""
    code = "from spmd.comm.registry import backends; print('DEFAULT', backends().for_device('cpu').spec.name)"
    assert "DEFAULT shm" in _run(code).stdout
    assert "DEFAULT mpi" in _run(code, env={"PMI_RANK": "0", "PMI_SIZE": "1"}).stdout


def test_spmd_plugins_lists_mpi():
    out = _run("from spmd.cli import main; main(['plugins'])").stdout
    assert "mpi  [plugin] spmd-mpi 0.1.0  loaded" in out
    assert "backends: mpi (cpu)" in out


def test_importing_the_plugin_does_not_import_mpi4py():
    out = _run(
        """
        import sys
        import spmd, spmd_mpi
        from spmd.comm.registry import backends
        spec = backends().get("mpi").spec
        spec.unavailable_reason(), spec.native_ops(), spec.description
        from spmd.cli import main
        main(["doctor"])
        print("IMPORTED" if "mpi4py" in sys.modules else "CLEAN")
        """
    ).stdout
    assert out.strip().endswith("CLEAN"), out


@needs_mpi
def test_description_names_the_implementation_and_version():
    spec = backends().get("mpi").spec
    implementation = probe.library_implementation()
    assert implementation and implementation in spec.description, spec.description
    assert "mpi4py" in spec.description


def test_doctor_says_what_to_install_without_mpi4py():
    block = "import sys; sys.modules['mpi4py'] = None\n"
    doctor = _run(block + "from spmd.cli import main; main(['doctor'])").stdout
    line = next(line for line in doctor.splitlines() if "mpi [cpu]" in line)
    assert "NOT usable" in line and "mpi4py" in line
    assert "pip install 'spmd-mpi[mpich]'" in line and "pip install -e 'plugins/mpi[mpich]'" in line
    assert "default for cpu: shm for a group whose ranks share one host" in doctor and "else gloo" in doctor
    plugins = _run(block + "from spmd.cli import main; main(['plugins'])").stdout
    assert "mpi  [plugin] spmd-mpi 0.1.0  loaded" in plugins
    init = _run(
        block
        + """
import spmd, torch
try:  # init checks the name; usability is checked at the latest on first use
    spmd.init("mpi", store=torch.distributed.HashStore(), rank=0, world_size=1)
    spmd.all_reduce(torch.ones(1))
except spmd.BackendUnavailableError as error:
    print("ERROR", error)
""")
    assert "ERROR backend 'mpi'" in init.stdout and "pip install 'spmd-mpi[mpich]'" in init.stdout


@pytest.mark.parametrize("env, usable", [
    ({"RANK": "0", "WORLD_SIZE": "2"}, False),                   # torchrun / spmd run
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}, False),          # srun without an MPI plugin
    ({"PMI_RANK": "0", "PMI_SIZE": "2"}, True),                   # Hydra mpiexec
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}, True),
    ({}, True),                                                   # a plain process: world of one
])
def test_available_only_where_mpi_can_run_the_job(monkeypatch, env, usable):
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", *probe.MPI_RANK_VARS, *probe.MPI_SIZE_VARS):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if probe.mpi4py_missing() or probe.library_missing():
        pytest.skip("mpi4py or libmpi is missing here")
    reason = backends().get("mpi").spec.unavailable_reason()
    if usable:
        assert reason is None  # which backend is the default: test_mpi_is_the_default_only_under_mpiexec
    else:
        assert reason is not None and "mpiexec -n N" in reason
        assert backends().for_device("cpu").spec.name == "shm"  # spmd.init() falls back (one host)
        assert backends().for_device("cpu", lambda: True).spec.name == "gloo"  # (a group across hosts)


# -- launchers ---------------------------------------------------------------------------
def _fake_mpiexec(tmp_path, banner: str) -> str:
    path = tmp_path / "mpiexec"
    path.write_text(f"#!/bin/sh\necho '{banner}'\n")
    path.chmod(0o755)
    return str(path)


def test_mismatched_mpiexec_is_named_with_the_right_one(tmp_path):
    fake = _fake_mpiexec(tmp_path, "mpiexec (Open MPI) 5.0.5")
    assert probe.mpiexec_implementation(fake) == "Open MPI"
    reason = probe.check_mpiexec(fake, library="MPICH")
    assert reason is not None
    assert fake in reason and "Open MPI" in reason and "MPICH" in reason and "one-rank jobs" in reason
    assert probe.check_mpiexec(fake, library="Open MPI") is None
    hydra = _fake_mpiexec(tmp_path / "..", "HYDRA build details:\n    Version: 4.2.0")
    assert probe.check_mpiexec(hydra, library="Intel MPI") is None  # one family: Hydra and PMI
    assert probe.mpiexec_command(3, fake)[:4] == [fake, "--oversubscribe", *(["--allow-run-as-root"] if os.geteuid() == 0 else []), "-n"][:4]
    assert probe.mpiexec_command(3, hydra) == [hydra, "-n", "3"]


@needs_mpi
def test_found_mpiexec_matches_the_library():
    path, why = probe.find_mpiexec()
    assert path is not None, why
    assert probe.check_mpiexec(path) is None
    assert probe.mpiexec_implementation(path) != "unknown"


@needs_mpi
def test_mpiexec_that_does_not_match_the_library_is_detected_at_run_time():
    """A foreign mpiexec starts N singletons: the first collective says so, naming the right mpiexec."""
    code = """
        import spmd, torch
        spmd.init("mpi", store=torch.distributed.HashStore(), rank=0, world_size=2)
        try:
            spmd.all_reduce(torch.ones(1))
        except spmd.BackendUnavailableError as error:
            print("ERROR", error)
        """
    out = _run(code, env={"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}).stdout
    assert "ERROR" in out and "Open MPI's mpiexec" in out and "does not belong to this MPI library" in out
    assert probe.find_mpiexec()[0] in out


@needs_mpi
def test_two_mpiexec_jobs_at_once_on_one_node():
    """Each job derives its own store port: two jobs without MASTER_PORT run side by side."""
    code = "import spmd, torch; spmd.init('mpi'); t = torch.ones(1); spmd.all_reduce(t); import os; os.write(1, f'SUM {int(t.item())}\\n'.encode()); spmd.destroy_process_group()"
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    cmd = [*probe.mpiexec_command(2), sys.executable, "-c", code]
    jobs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for job in jobs:
        out, err = job.communicate(timeout=120)
        assert job.returncode == 0 and out.count("SUM 2") == 2, out + err


@needs_mpi
def test_without_mpiexec_a_multi_rank_world_says_how_to_launch():
    with World(2, "mpi", collective_timeout=20) as world:
        messages = world.run(mpi_helpers.all_reduce_error)
    for message in messages:
        assert "MPI singleton" in message and "mpiexec -n 2" in message


# -- real worlds under mpiexec --------------------------------------------------------------
@needs_mpi
@pytest.mark.parametrize("n", [1, 2, 3])
def test_world_under_mpiexec_is_the_mpi_world(spmd_world, n):
    results = spmd_world(n, None, launcher=MPIEXEC).run(mpi_helpers.identity)  # None: spmd.init() picks
    for rank, seen in enumerate(results):
        assert seen == {"rank": rank, "size": n, "mpi_rank": rank, "mpi_size": n, "backend": "mpi",
                        "sum": [float(n)] * 3, "thread_level": True}


@needs_mpi
def test_mpi4py_is_imported_only_by_the_backend():
    with World(2, "gloo", launcher=MPIEXEC) as world:  # launched by mpiexec, never uses MPI
        assert world.run(mpi_helpers.imported_mpi4py_before_use) == [False, False]


@needs_mpi
def test_async_ops_futures_polling_and_batches(spmd_world):
    results = spmd_world(2, "mpi", launcher=MPIEXEC).run(mpi_helpers.overlapping_async, 9)
    assert results[0] == [float(i) for i in range(9)] + [1.0]
    assert results[1] == [float(i) for i in range(9)] + [0.0]


@needs_mpi
def test_wait_times_out_then_the_same_op_completes(spmd_world):
    results = spmd_world(2, "mpi", launcher=MPIEXEC).run(mpi_helpers.timeout_then_recover)
    seconds, _, message = results[0].partition(" ")
    assert 0.4 < float(seconds.rstrip("s")) < 5, results[0]
    assert "did not complete within 0.5 s" in message and "all_reduce" in message


@needs_mpi
def test_many_sub_communicators(spmd_world):
    n, rounds = 3, 20
    results = spmd_world(n, "mpi", launcher=MPIEXEC).run(mpi_helpers.many_groups, rounds)
    color = mpi_helpers.group_color
    expected = [sum(sum(color(q, i) == color(r, i) for q in range(n)) for i in range(rounds)) for r in range(n)]
    assert results == expected


@needs_mpi
def test_a_failing_rank_fails_the_world_and_leaves_no_processes():
    world = World(2, "mpi", launcher=MPIEXEC)
    try:
        with pytest.raises(RankFailure, match="rank 1"):
            world.run(mpi_helpers.fail_on, 1)
    finally:
        world.close()
    assert not world.alive
    assert world._procs[0].poll() is not None


def test_counts_are_bytes_and_displacements():
    from spmd_mpi.backend import _counts

    assert _counts([2, 0, 1], 12) == ([24, 0, 12], [0, 24, 24])
    assert _counts([], 4) == ([], [])


def test_reduce_table_covers_every_valid_pair():
    if probe.mpi4py_missing() or probe.library_missing():
        pytest.skip("mpi4py or libmpi is missing here")
    out = _run(
        """
        import torch
        from spmd.testing.conformance.data import REDUCE_DTYPES, valid_ops
        from spmd.comm.reduce_op import ReduceOp
        from spmd_mpi import backend
        backend.load_mpi()
        missing = [(str(d), op.name) for d in REDUCE_DTYPES for op in valid_ops(d) if op is not ReduceOp.AVG
                   and d not in backend._STAGED and d not in backend._REDUCE[op]]
        print(missing)
        """
    ).stdout
    assert out.strip() == "[]", out


_ = spmd  # the module is imported for its side effects on the plugin manager


# -- aborting a request ---------------------------------------------------------------------
class _PostedRequest:
    """An MPI request that MPI has not completed (until ``done``)."""

    def __init__(self) -> None:
        self.done = False

    def Test(self) -> bool:  # noqa: N802 - mpi4py's name
        return self.done


def test_an_aborted_request_fails_its_waiter_and_keeps_its_buffers_until_mpi_completes_it():
    """The kernel aborts what it gave up on (its deadline, or its group given up elsewhere): a wait in
    another thread returns at once, and the tensors MPI may still write outlive the dropped handle."""
    import threading

    import torch

    from spmd_mpi import work as mpi_work

    request, buffer = _PostedRequest(), torch.ones(4)
    handle = mpi_work.MpiWork(request, buffer, None, buffer.nbytes)
    waited: list[bool] = []
    waiter = threading.Thread(target=lambda: waited.append(handle.wait(30.0)))
    waiter.start()
    handle.abort()
    waiter.join(5)
    assert waited == [True] and "gave up" in str(handle.error())
    assert handle.poll() and handle.wait(0) is True
    assert any(r is request and k is buffer for r, k in mpi_work._ABANDONED)
    request.done = True  # MPI completes it at last: the next abandoned request prunes it
    mpi_work._abandon(None, None)
    assert not any(r is request for r, _ in mpi_work._ABANDONED)
