"""`spmd run`: torchrun compatibility, multi-agent rendezvous, restarts, signals, logs, elastic joins."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from spmd.testing.ports import free_port

SCRIPTS = Path(__file__).parent / "launch_scripts"
EXAMPLES = Path(__file__).parent.parent / "examples"
SPMD = [sys.executable, "-m", "spmd"]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")}
    env.update(extra)
    return env


def reports(stdout: str) -> list[dict]:
    return sorted((json.loads(line.split("REPORT ", 1)[1]) for line in stdout.splitlines() if "REPORT " in line), key=lambda r: int(r["env"]["RANK"]))


def test_torchrun_script_runs_unchanged_one_node_four_workers():
    out = subprocess.run([*SPMD, "run", "--nproc-per-node", "4", str(SCRIPTS / "report.py"), "--lr", "0.1"], env=clean_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = reports(out.stdout)
    assert [r["env"]["RANK"] for r in rows] == ["0", "1", "2", "3"]
    for r in rows:
        assert r["env"]["WORLD_SIZE"] == "4" and r["env"]["LOCAL_WORLD_SIZE"] == "4" and r["env"]["GROUP_RANK"] == "0"
        assert r["env"]["LOCAL_RANK"] == r["env"]["RANK"]
        assert r["env"]["TORCHELASTIC_RESTART_COUNT"] == r["env"]["SPMD_RESTART_COUNT"] == "0"
        assert r["env"]["OMP_NUM_THREADS"] == "1"
        assert r["sum"] == 6.0 and r["args"] == ["--lr", "0.1"]


@pytest.mark.parametrize("script", ["report.py", "spmd_report.py"])
def test_two_agents_two_workers_each(script):
    port = free_port()
    cmd = [*SPMD, "run", "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two", str(SCRIPTS / script)]
    agents = [subprocess.Popen(cmd, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [a.communicate(timeout=120) for a in agents]
    assert all(a.returncode == 0 for a in agents), [o[1] for o in outs]
    rows = reports("".join(o[0] for o in outs))
    assert [r["env"]["RANK"] for r in rows] == ["0", "1", "2", "3"]
    assert sorted({r["env"]["GROUP_RANK"] for r in rows}) == ["0", "1"]
    assert all(r["env"]["LOCAL_WORLD_SIZE"] == "2" and r["sum"] == 6.0 for r in rows)


def test_static_node_ranks_are_honoured():
    port = free_port()
    base = [*SPMD, "run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "static"]
    # node 1 starts first: with static ranks it must still get GROUP_RANK 1
    second = subprocess.Popen([*base, "--node-rank", "1", str(SCRIPTS / "report.py")], env=clean_env(), stdout=subprocess.PIPE, text=True)
    first = subprocess.Popen([*base, "--node-rank", "0", str(SCRIPTS / "report.py")], env=clean_env(), stdout=subprocess.PIPE, text=True)
    out1, out0 = second.communicate(timeout=120)[0], first.communicate(timeout=120)[0]
    assert second.returncode == first.returncode == 0
    assert reports(out1)[0]["env"]["GROUP_RANK"] == "1" and reports(out1)[0]["env"]["RANK"] == "1"
    assert reports(out0)[0]["env"]["GROUP_RANK"] == "0"


def test_kill_9_restarts_the_group_and_the_job_finishes():
    out = subprocess.run([*SPMD, "run", "--nproc-per-node", "2", "--max-restarts", "2", str(SCRIPTS / "crash.py")], env=clean_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert sorted(line for line in out.stdout.splitlines() if line.startswith("FINISHED")) == ["FINISHED rank=0 restart=1", "FINISHED rank=1 restart=1"]
    assert "rank 1 (local rank 1) on node 0" in out.stderr and "killed by signal SIGKILL; restarting the group (1/2)" in out.stderr


def test_without_restarts_the_agent_exits_fast_naming_rank_and_signal():
    start = time.monotonic()
    out = subprocess.run([*SPMD, "run", "--nproc-per-node", "2", "--max-restarts", "0", str(SCRIPTS / "crash.py")], env=clean_env(), capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - start
    assert out.returncode == 128 + signal.SIGKILL
    assert "job failed; restarts used 0/0" in out.stderr
    assert "rank 1 (local rank 1) on node 0 (127.0.0.1) killed by signal SIGKILL" in out.stderr
    # "Fast" means without waiting out rank 0's collective timeout (SPMD_TIMEOUT=600 s by default):
    # the run includes interpreter start-up and `import torch` in the agent and both workers, which
    # measured 2-3 s idle and 16 s on a loaded 2-core machine, so the bound is a few times that.
    assert elapsed < 60, elapsed


def test_a_worker_killed_by_a_signal_is_named_before_those_that_exited_after_it(monkeypatch):
    """On a loaded machine rank 0 may exit (its collective broke) before the agent looks at rank 1,
    which was SIGKILLed: the agent must still name rank 1's signal as the failure, not rank 0's exit."""
    import types

    from spmd.launch.workers import WorkerGroup

    def worker(rank, code):
        return types.SimpleNamespace(rank=rank, proc=types.SimpleNamespace(poll=lambda: code))

    group = WorkerGroup.__new__(WorkerGroup)
    monkeypatch.setattr(group, "_failure", lambda w, code: (w.rank, code), raising=False)
    group.workers = [worker(0, 1), worker(1, -signal.SIGKILL), worker(2, None)]
    assert group.poll() == (False, (1, -signal.SIGKILL))
    group.workers = [worker(0, None), worker(1, 2), worker(2, 1)]
    assert group.poll() == (False, (1, 2))  # no signal: the lowest rank that failed
    group.workers = [worker(0, 0), worker(1, 0)]
    assert group.poll() == (True, None)


def test_python_error_summary_shows_the_traceback():
    out = subprocess.run([*SPMD, "run", "--nproc-per-node", "2", str(SCRIPTS / "raise_error.py")], env=clean_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    before, summary = out.stderr.split("job failed", 1)
    assert "rank 0 (local rank 0) on node 0 (127.0.0.1) exited with code 1" in summary
    assert "its error is printed above (once)" in summary
    # rank 0's traceback reaches the terminal once, as the rank wrote it, and is not repeated
    assert before.count("ValueError: bad learning rate 42") == 1 and "Traceback (most recent call last)" in before, before
    assert "ValueError" not in summary, summary


def _wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize(("signum", "flags"), [(signal.SIGINT, []), (signal.SIGTERM, []), (signal.SIGHUP, []),
                                              (signal.SIGUSR1, ["--signals-to-handle", "SIGTERM,SIGUSR1"])])
def test_signal_to_the_agent_reaches_every_worker(tmp_path, signum, flags):
    """torchrun's default set (SIGTERM, SIGINT, SIGHUP, SIGQUIT) and what --signals-to-handle adds reach every
    worker's handler (a SIGHUP killed the agent, and with it the workers, before they could act)."""
    agent = subprocess.Popen([*SPMD, "run", "--nproc-per-node", "2", *flags, str(SCRIPTS / "sleeper.py"), str(tmp_path)],
                             env=clean_env(), stderr=subprocess.PIPE, text=True)
    _wait_for(lambda: len(list(tmp_path.glob("pid*"))) == 2, 60, "both workers to start")
    pids = [int(p.read_text()) for p in tmp_path.glob("pid*")]
    agent.send_signal(signum)
    _, err = agent.communicate(timeout=30)
    assert agent.returncode == 128 + signum
    assert f"received {signal.Signals(signum).name}" in err
    _wait_for(lambda: not any(_alive(p) for p in pids), 10, "workers to exit")
    assert [(tmp_path / f"got{r}").read_text() for r in (0, 1)] == [signal.Signals(signum).name] * 2


def test_kill_9_of_the_agent_leaves_no_orphan(tmp_path):
    agent = subprocess.Popen([*SPMD, "run", "--nproc-per-node", "2", str(SCRIPTS / "sleeper.py"), str(tmp_path)], env=clean_env())
    _wait_for(lambda: len(list(tmp_path.glob("pid*"))) == 2, 60, "both workers to start")
    pids = [int(p.read_text()) for p in tmp_path.glob("pid*")]
    agent.kill()
    agent.wait(timeout=10)
    _wait_for(lambda: not any(_alive(p) for p in pids), 10, "workers to die with their agent")


def _log_dirs(root, rdzv_id: str) -> list:
    """The runs' own log directories under --log-dir ``root``: ``<rdzv_id>_<random>``, one per agent run."""
    return sorted(root.glob(f"{rdzv_id}_*"))


def test_tee_prefixes_and_log_dir_keeps_per_rank_files(tmp_path):
    """Two runs with one --log-dir and --rdzv-id keep their own files (the second truncated the first's)."""
    for _ in range(2):
        out = subprocess.run(
            [*SPMD, "run", "--nproc-per-node", "2", "--tee", "3", "--log-dir", str(tmp_path), "--rdzv-id", "logs", str(SCRIPTS / "report.py")],
            env=clean_env(), capture_output=True, text=True, timeout=120,
        )
        assert out.returncode == 0, out.stderr
        assert any(line.startswith("[rank0]: REPORT ") for line in out.stdout.splitlines())
        assert any(line.startswith("[rank1]: REPORT ") for line in out.stdout.splitlines())
        assert "worker logs in " + str(tmp_path / "logs_") in out.stderr, out.stderr
    runs = _log_dirs(tmp_path, "logs")
    assert len(runs) == 2, runs  # one directory per run: the second run no longer truncates the first's files
    for run in runs:
        for local in ("0", "1"):
            text = (run / "attempt_0" / local / "stdout.log").read_text()
            assert "REPORT " in text and not text.startswith("[rank")


def test_redirects_keep_output_off_the_console_and_need_no_log_dir(tmp_path):
    """Without --log-dir the files go to a temp directory that the agent names on stderr (as torchrun's)."""
    out = subprocess.run(
        [*SPMD, "run", "--nproc-per-node", "2", "--redirects", "1", "--rdzv-id", "quiet", str(SCRIPTS / "report.py")],
        env={**clean_env(), "TMPDIR": str(tmp_path)}, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0 and "REPORT" not in out.stdout, out.stderr
    (run,) = _log_dirs(tmp_path, "quiet")
    assert f"worker logs in {run}/" in out.stderr
    assert "REPORT " in (run / "attempt_0" / "1" / "stdout.log").read_text()


def test_module_and_no_python_forms(tmp_path):
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "job.py").write_text((SCRIPTS / "report.py").read_text())
    out = subprocess.run([*SPMD, "run", "--nproc-per-node", "2", "-m", "mypkg.job", "x"], env=clean_env(PYTHONPATH=str(tmp_path)), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert [r["args"] for r in reports(out.stdout)] == [["x"], ["x"]]
    exe = tmp_path / "job.sh"
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} {SCRIPTS / 'report.py'} \"$@\"\n")
    exe.chmod(0o755)
    out = subprocess.run([*SPMD, "run", "--nproc-per-node", "2", "--no-python", str(exe), "y"], env=clean_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert [r["args"] for r in reports(out.stdout)] == [["y"], ["y"]]


def test_elastic_join_restarts_with_the_new_world_size_and_resumes(tmp_path):
    port = free_port()
    ckpt = tmp_path / "state.pt"
    cmd = [*SPMD, "run", "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic", "--last-call", "0.5",
           str(EXAMPLES / "elastic_resume.py"), str(ckpt), "40", "0.05", "2"]
    first = subprocess.Popen(cmd, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(ckpt.exists, 60, "the first node to train alone")
    second = subprocess.Popen(cmd, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out0, err0 = first.communicate(timeout=120)
    out1, err1 = second.communicate(timeout=120)
    assert first.returncode == second.returncode == 0, (err0, err1)
    state = json.loads(next(line for line in (out0 + out1).splitlines() if line.startswith("ELASTIC "))[len("ELASTIC "):])
    assert state["step"] >= 40 and state["world_size"] == 2  # finished in a world of two...
    assert state["history"][0] == 1  # ...resuming what a world of one started
    assert "a node asked to join" in err0 + err1


def test_srun_and_mpiexec_environments_are_detected_without_spmd_run():
    code = "import spmd; spmd.init('gloo'); import torch; t=torch.ones(1); spmd.all_reduce(t); print(spmd.get_rank(), spmd.get_world_size(), int(t.item())); spmd.destroy_process_group()"
    port = free_port()
    variants = {
        "slurm": lambda r: {"SLURM_PROCID": str(r), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(r), "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_ID": "1", "MASTER_PORT": str(port)},
        "openmpi": lambda r: {"OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": str(r), "MASTER_PORT": str(port + 1)},
        "mpich": lambda r: {"PMI_RANK": str(r), "PMI_SIZE": "2", "MPI_LOCALRANKID": str(r), "MASTER_PORT": str(port + 2)},
    }
    for name, env_of in variants.items():
        procs = [subprocess.Popen([sys.executable, "-c", code], env=clean_env(**env_of(r)), stdout=subprocess.PIPE, text=True) for r in range(2)]
        outs = sorted(p.communicate(timeout=60)[0].strip() for p in procs)
        assert outs == ["0 2 2", "1 2 2"], (name, outs)


def test_mpiexec_jobs_on_one_node_derive_distinct_store_ports(monkeypatch):
    """Without MASTER_PORT, each mpiexec job gets its own store port (no collision on 29500)."""
    from spmd.launch.environments import MpiEnvironment

    for name in ("MASTER_ADDR", "MASTER_PORT", "PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PMI_RANK", "0")
    monkeypatch.setenv("PMI_SIZE", "2")
    env = MpiEnvironment()
    monkeypatch.setattr(os, "getppid", lambda: 4242)  # Hydra's proxy: shared by the job's ranks on a node
    first = env.launch_info().master_port
    assert env.launch_info().master_port == first
    monkeypatch.setattr(os, "getppid", lambda: 4343)  # another job's proxy
    assert env.launch_info().master_port != first
    monkeypatch.setenv("PMIX_NAMESPACE", "prterun-vm-1234@1")  # Open MPI: the same on every node
    by_namespace = env.launch_info().master_port
    monkeypatch.setattr(os, "getppid", lambda: 99)
    assert env.launch_info().master_port == by_namespace
    monkeypatch.setenv("MASTER_PORT", "23456")
    assert env.launch_info().master_port == 23456


def _netns_available() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    probe = subprocess.run(["ip", "netns", "add", "spmdprobe"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns add` is not allowed here: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", "spmdprobe"], capture_output=True)
    return None


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair: 10.77.<k>.1 and 10.77.<k>.2, nothing else."""
    reason = _netns_available()
    if reason:
        pytest.skip(f"network-namespace test skipped: {reason}")
    k = os.getpid() % 200 + 20
    names = [f"spmd{k}a", f"spmd{k}b"]
    ips = [f"10.77.{k}.1", f"10.77.{k}.2"]
    cmds = [
        ["ip", "netns", "add", names[0]], ["ip", "netns", "add", names[1]],
        ["ip", "link", "add", f"v{k}a", "type", "veth", "peer", "name", f"v{k}b"],
        ["ip", "link", "set", f"v{k}a", "netns", names[0]], ["ip", "link", "set", f"v{k}b", "netns", names[1]],
    ]
    for ns, dev, ip in zip(names, (f"v{k}a", f"v{k}b"), ips):
        cmds += [["ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev], ["ip", "-n", ns, "link", "set", dev, "up"], ["ip", "-n", ns, "link", "set", "lo", "up"]]
    try:
        for cmd in cmds:
            subprocess.run(cmd, check=True, capture_output=True)
        yield list(zip(names, (f"v{k}a", f"v{k}b"), ips))
    finally:
        for ns in names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.mark.parametrize("script", ["report.py", "spmd_report.py"])
def test_two_agents_across_network_namespaces(two_hosts, script):
    (ns0, dev0, ip0), (ns1, dev1, _) = two_hosts
    port = 29400
    base = [*SPMD, "run", "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", f"{ip0}:{port}", "--rdzv-id", "netns"]
    agents = [
        subprocess.Popen(["ip", "netns", "exec", ns, *base, "--node-rank", str(i), str(SCRIPTS / script)],
                         env=clean_env(GLOO_SOCKET_IFNAME=dev), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i, (ns, dev) in enumerate(((ns0, dev0), (ns1, dev1)))
    ]
    outs = [a.communicate(timeout=120) for a in agents]
    assert all(a.returncode == 0 for a in agents), [o[1][-2000:] for o in outs]
    rows = reports("".join(o[0] for o in outs))
    assert [r["env"]["RANK"] for r in rows] == ["0", "1", "2", "3"] and all(r["sum"] == 6.0 for r in rows)


def test_a_slow_console_gets_every_line_of_a_job_that_succeeded(tmp_path):
    """The agent waits for its forwarding threads: a console that reads late still gets every line.

    Each worker writes about 50 KB, which its own pipe holds, and exits at once; together they overfill
    the console's pipe, which nobody reads for a while: the agent sees every worker done while its
    forwarding threads are still blocked on the console (it returned then, and the rest was lost)."""
    proc = subprocess.Popen([*SPMD, "run", "--nproc-per-node", "2", str(SCRIPTS / "chatty.py"), "700"],
                            env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    time.sleep(8)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err.decode()
    assert out.count(b"line ") == 2 * 700


def test_a_console_that_closes_does_not_block_the_workers(tmp_path):
    """`spmd run ... | head -1`: the console goes away; the workers still finish and the log files get everything."""
    proc = subprocess.Popen([*SPMD, "run", "--nproc-per-node", "2", "--tee", "1", "--log-dir", str(tmp_path), "--rdzv-id", "closed",
                             str(SCRIPTS / "chatty.py"), "20000"], env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    proc.stdout.readline()
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err.decode()
    for local in ("0", "1"):
        assert (_log_dirs(tmp_path, "closed")[0] / "attempt_0" / local / "stdout.log").read_text().count("line ") == 20000


def test_a_failed_workers_helper_processes_are_stopped_with_the_job(tmp_path):
    """Rank 0 starts a helper and exits 3 while rank 1 runs on: stopping the job reaches rank 0's helper
    too (its process group was skipped once its leader had exited, leaving the helper running)."""
    out = subprocess.run([*SPMD, "run", "--nproc-per-node", "2", str(SCRIPTS / "helper_child.py"), str(tmp_path)],
                         env=clean_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 3, out.stderr
    helpers = [int((tmp_path / f"helper{r}").read_text()) for r in (0, 1)]
    _wait_for(lambda: not any(_alive(p) for p in helpers), 10, "both ranks' helpers to be stopped")


def test_tee_prefixes_each_line_once():
    """torch.distributed's excepthook already writes ``[rank0]: `` before each traceback line of a torch-started
    world; the agent's --tee prefix is not added again (it printed ``[rank0]: [rank0]: ``)."""
    import io

    from spmd.launch.workers import _Sink

    console = io.BytesIO()
    read, write = os.pipe()
    with os.fdopen(write, "wb") as w:
        w.write(b"[rank0]: Traceback (most recent call last):\nplain line\n")
    with os.fdopen(read, "rb") as r:
        _Sink(console, b"[rank0]: ", None, None).pump(r)
    assert console.getvalue() == b"[rank0]: Traceback (most recent call last):\n[rank0]: plain line\n"


# -- one agent with stand-in workers, the other nodes simulated over an in-process store ----------------------------


class FakeGroup:
    """Stands in for WorkerGroup: its workers 'exit' as ``result`` says; ``stop`` only records the signal."""

    made: list[FakeGroup] = []
    first_result: tuple = (True, None)  # what a new group's poll says: (all exited 0, failure)

    def __init__(self, config, membership, restart, run_dir, log_root=None):
        self.membership, self.restart = membership, restart
        self.result = FakeGroup.first_result
        self.stopped: list[int] = []
        self.on_stop = lambda: None
        FakeGroup.made.append(self)

    def start(self):
        pass

    def poll(self):
        return self.result

    def drain(self, timeout=10.0):
        pass

    def stop(self, signum=signal.SIGTERM):
        self.stopped.append(signum)
        self.on_stop()


def _config(**changes):
    from dataclasses import replace

    from spmd.launch.args import RunConfig

    base = RunConfig(nproc_per_node=1, min_nodes=2, max_nodes=2, node_rank=0, rdzv_endpoint="127.0.0.1:1", rdzv_id="unit", standalone=False,
                     max_restarts=0, monitor_interval=0.01, redirects={0: 0}, tee={0: 0}, log_dir=None, module=False, no_python=False,
                     script="x.py", script_args=(), rdzv_timeout=30.0, last_call=0.0, stop_grace=1.0)
    return replace(base, **changes)


def _agent(monkeypatch, tmp_path, store, hosting: bool, endpoint: str = "127.0.0.1:1", **changes):
    """An Agent whose rendezvous runs over ``store`` and whose workers are FakeGroups."""
    import tempfile

    from spmd.launch import agent as agent_module
    from spmd.launch.rendezvous import Rendezvous

    config = _config(rdzv_endpoint=endpoint, **changes)

    def rendezvous(self):
        self._store, self._endpoint = store, endpoint
        return Rendezvous(store, config.rdzv_id, config.min_nodes, config.max_nodes, config.rdzv_timeout, config.last_call, poll=0.01), hosting, "127.0.0.1"

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(agent_module.Agent, "_rendezvous", rendezvous)
    monkeypatch.setattr(agent_module, "WorkerGroup", FakeGroup)
    FakeGroup.made, FakeGroup.first_result = [], (True, None)
    return agent_module.Agent(config)


def _other_node(store, script, config=None):
    """Node 1 of a two-node job, run by ``script(rdzv)`` in a thread over the same store; returns (thread, errors)."""
    from spmd.launch.rendezvous import Rendezvous

    config = config or _config()
    rdzv = Rendezvous(store, config.rdzv_id, config.min_nodes, config.max_nodes, config.rdzv_timeout, config.last_call, poll=0.01)
    errors: list[BaseException] = []

    def body():
        try:
            script(rdzv)
        except BaseException as error:  # noqa: BLE001 - reported by the test
            errors.append(error)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, errors


def _run_beside(agent, thread, errors, capture) -> tuple[int, str]:
    """Run ``agent`` while the other node's thread plays its part; (exit code, the agent's stderr)."""
    code = agent.run()
    thread.join(30)
    assert not errors, errors
    return code, capture.readouterr().err


def _node1_failure():
    from spmd.launch.workers import Failure

    return Failure(rank=1, local_rank=0, node_rank=1, host="node1", returncode=3, detail="Traceback (most recent call last):\nOSError: disk full")


def _membership(num_nodes: int, round_: int = 0):
    from spmd.launch.rendezvous import Membership

    return Membership(round=round_, node_rank=0, num_nodes=num_nodes, nprocs=(1,) * num_nodes, hosts=("127.0.0.1",) * num_nodes,
                      master_addr="127.0.0.1", master_port=1)


def _wait_store(condition, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_monitor_sees_a_failed_round_even_when_its_own_workers_all_exited_0(monkeypatch, tmp_path):
    """The round's ``failed`` key is looked at before local success is trusted (it said "done")."""
    import torch.distributed as tdist

    from spmd.launch.rendezvous import Rendezvous

    store = tdist.HashStore()
    agent = _agent(monkeypatch, tmp_path, store, hosting=True)
    rdzv = Rendezvous(store, "unit", 2, 2, 30, 0)
    rdzv.set(0, "failed", _node1_failure().to_json())
    agent.group = FakeGroup(agent.config, None, 0, tmp_path)
    outcome, failure = agent._monitor(rdzv, _membership(num_nodes=2))
    assert (outcome, failure) == ("failed", _node1_failure())


@pytest.mark.parametrize("hosting", [True, False])
def test_a_node_whose_workers_succeeded_reports_a_later_failure_elsewhere(monkeypatch, tmp_path, capsys, hosting):
    """Node 0's workers all exit 0; then a rank on node 1 fails for good. Node 0's agent exits with that rank's
    code and the summary (it exited 0: the job read as a success)."""
    import torch.distributed as tdist

    store = tdist.HashStore()
    agent = _agent(monkeypatch, tmp_path, store, hosting=hosting)

    def node1(rdzv):
        rdzv.join(1, 1, "node1")
        _wait_store(lambda: int(rdzv.store.add(rdzv.key(0, "done"), 0)) == 1)  # node 0's workers are done
        rdzv.store.compare_set(rdzv.key(0, "failed"), "", _node1_failure().to_json())
        rdzv.store.set("shutdown", "job failed: rank 1 exited with code 3")  # no restarts left: node 1's agent exits

    thread, errors = _other_node(store, node1)
    code, err = _run_beside(agent, thread, errors, capsys)
    assert code == 3, err
    assert "job failed; restarts used 0/0" in err and "rank 1 (local rank 0) on node 1 (node1) exited with code 3" in err
    assert "OSError: disk full" in err  # node 1's last words: node 0's terminal did not show them


def test_the_agent_hosting_the_store_waits_for_the_others_to_read_a_final_failure(monkeypatch, tmp_path, capsys):
    """A worker of the hosting node fails for good: its agent keeps the store up until node 1's agent has read
    the failure and stopped its workers (it exited at once, and node 1 then reported a lost store, exit 1)."""
    import torch.distributed as tdist

    from spmd.launch.workers import Failure

    store = tdist.HashStore()
    agent = _agent(monkeypatch, tmp_path, store, hosting=True)
    FakeGroup.first_result = (False, Failure(rank=0, local_rank=0, node_rank=0, host="node0", returncode=3, detail=""))
    seen: list[float] = []

    def node1(rdzv):
        rdzv.join(1, 1, "node1")
        _wait_store(lambda: rdzv.store.check([rdzv.key(0, "failed")]))
        time.sleep(0.5)  # stopping its own workers
        seen.append(time.monotonic())
        rdzv.store.add(rdzv.key(0, "left"), 1)

    thread, errors = _other_node(store, node1)
    code = agent.run()
    returned = time.monotonic()
    thread.join(30)
    assert not errors, errors
    assert code == 3, capsys.readouterr().err
    assert seen and returned >= seen[0]


def test_a_node_whose_workers_succeeded_takes_part_in_the_restart(monkeypatch, tmp_path, capsys):
    """With a restart left, node 0 (workers done) rejoins when node 1 fails, so the restart can form; the job
    then succeeds in round 1 (node 0 exited 0 at once, and node 1 waited for it until the rendezvous timed out)."""
    import torch.distributed as tdist

    store = tdist.HashStore()
    agent = _agent(monkeypatch, tmp_path, store, hosting=False, max_restarts=1)

    def node1(rdzv):
        rdzv.join(1, 1, "node1")
        _wait_store(lambda: int(rdzv.store.add(rdzv.key(0, "done"), 0)) == 1)
        rdzv.store.compare_set(rdzv.key(0, "failed"), "", _node1_failure().to_json())
        rdzv.advance_from(0)
        assert rdzv.join(1, 1, "node1").round == 1
        rdzv.store.add(rdzv.key(1, "done"), 1)  # node 1's workers succeed this time
        _wait_store(lambda: int(rdzv.store.add(rdzv.key(1, "done"), 0)) == 2)

    thread, errors = _other_node(store, node1)
    code, err = _run_beside(agent, thread, errors, capsys)
    assert code == 0, err
    assert [g.restart for g in FakeGroup.made] == [0, 1] and [g.membership.round for g in FakeGroup.made] == [0, 1]
    assert "rank 1 (local rank 0) on node 1 (node1) exited with code 3; restarting the group (1/1)" in err


def test_a_node_whose_workers_succeeded_follows_the_job_into_a_new_round_and_ignores_late_joins(monkeypatch, tmp_path):
    """Once a node's workers finished, the running agents no longer restart the job for a newcomer; an agent whose
    workers finished and whose round was moved on anyway (the two crossed) goes with it instead of waiting alone."""
    import torch.distributed as tdist

    from spmd.launch.rendezvous import Rendezvous

    store = tdist.HashStore()
    agent = _agent(monkeypatch, tmp_path, store, hosting=False, max_nodes=3)
    rdzv = Rendezvous(store, "unit", 2, 3, 30, 0)
    agent.group = FakeGroup(agent.config, None, 0, tmp_path)
    agent.group.result = (False, None)  # still running
    rdzv.set(0, "join", "node2")
    rdzv.store.add(rdzv.key(0, "done"), 1)  # node 1's workers finished
    threading.Timer(0.5, lambda: rdzv.store.set("shutdown", "test over")).start()
    assert agent._monitor(rdzv, _membership(num_nodes=2)) == ("shutdown", None)  # not "join"

    rdzv.advance_from(0)  # the other agent had taken the join before node 1 finished
    assert agent._await_job(rdzv, 0, 2, hosting=False) == ("join", None)


def _hosted_store():
    """A TCPStore server in this process (a list holding it: clear the list to take the store down) and a client."""
    from datetime import timedelta

    import torch.distributed as tdist

    server = tdist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
    client = tdist.TCPStore("127.0.0.1", server.port, None, False, timedelta(seconds=30))
    return [server], client, f"127.0.0.1:{server.port}"


def _client(endpoint: str):
    from datetime import timedelta

    import torch.distributed as tdist

    host, _, port = endpoint.rpartition(":")
    return tdist.TCPStore(host, int(port), None, False, timedelta(seconds=30))


def test_losing_the_store_stops_the_workers_gracefully_and_says_so(monkeypatch, tmp_path, capfd):
    """The agent hosting the store dies while this one watches its workers: one line saying what happened, the
    workers stopped with SIGTERM and the grace period, exit code 1 (a traceback escaped, the workers got PDEATHSIG)."""
    holder, client, endpoint = _hosted_store()
    agent = _agent(monkeypatch, tmp_path, client, hosting=False, endpoint=endpoint, node_rank=1)

    def node0(rdzv):
        rdzv.join(1, 0, "node0")
        _wait_store(lambda: bool(FakeGroup.made))
        time.sleep(0.2)
        holder.clear()  # node 0's agent dies, and its store with it

    FakeGroup.first_result = (False, None)  # the workers run on
    thread, errors = _other_node(_client(endpoint), node0)
    code, err = _run_beside(agent, thread, errors, capfd)
    assert code == 1, err
    assert f"spmd run: lost the rendezvous store at {endpoint}: the agent hosting it exited or died" in err
    assert "Traceback" not in err
    assert FakeGroup.made[0].stopped == [signal.SIGTERM]


def test_a_stop_request_is_reported_when_its_sender_takes_the_store_down_meanwhile(monkeypatch, tmp_path, capfd):
    """Node 0 got SIGTERM: it publishes the reason, stops its workers and exits with its store while this agent's
    workers get their grace period; the reason was read after that, from a store already gone."""
    holder, client, endpoint = _hosted_store()
    agent = _agent(monkeypatch, tmp_path, client, hosting=False, endpoint=endpoint, node_rank=1)

    def node0(rdzv):
        rdzv.join(1, 0, "node0")
        _wait_store(lambda: bool(FakeGroup.made))
        FakeGroup.made[0].on_stop = holder.clear  # node 0 exits during this node's grace period
        rdzv.store.set("shutdown", "agent on node0 received SIGTERM")

    FakeGroup.first_result = (False, None)  # the workers run on
    thread, errors = _other_node(_client(endpoint), node0)
    code, err = _run_beside(agent, thread, errors, capfd)
    assert code == 1, err
    assert "spmd run: job stopped: agent on node0 received SIGTERM" in err and "Traceback" not in err


def test_a_full_round_is_not_restarted_for_a_join_request(monkeypatch, tmp_path):
    """A round that has --nnodes' maximum of nodes ignores a join request (a surplus agent's ask restarted it)."""
    import torch.distributed as tdist

    from spmd.launch.rendezvous import Rendezvous

    store = tdist.HashStore()
    agent = _agent(monkeypatch, tmp_path, store, hosting=True, min_nodes=1, max_nodes=2)
    rdzv = Rendezvous(store, "unit", 1, 2, 30, 0)
    agent.group = FakeGroup(agent.config, None, 0, tmp_path)
    agent.group.result = (False, None)
    rdzv.set(0, "join", "node2")
    threading.Timer(0.5, lambda: rdzv.store.set("shutdown", "test over")).start()
    assert agent._monitor(rdzv, _membership(num_nodes=2)) == ("shutdown", None)  # full: not "join"
    rdzv.store.delete_key("shutdown")
    assert agent._monitor(rdzv, _membership(num_nodes=1)) == ("join", None)  # room for one more


# -- forwarding worker output ---------------------------------------------------------------------------------------


class _Console:
    """A console that records what reached it, and when something first did."""

    def __init__(self):
        self.data = bytearray()
        self.got = threading.Event()

    def write(self, data):
        self.data += data
        self.got.set()
        return len(data)

    def flush(self):
        pass


def test_a_progress_bar_reaches_the_console_as_it_moves(tmp_path):
    """tqdm redraws one line with \\r and writes \\n only at the end: each update is forwarded as it comes,
    to the console (prefixed at each redraw under --tee) and to the log file (nothing showed before the \\n)."""
    from spmd.launch.workers import _Sink

    console = _Console()
    log = open(tmp_path / "stderr.log", "wb")  # noqa: SIM115 - the sink closes it
    read, write = os.pipe()
    sink = _Sink(console, b"[rank0]: ", log, None)
    with os.fdopen(read, "rb") as r, os.fdopen(write, "wb", buffering=0) as w:
        thread = threading.Thread(target=sink.pump, args=(r,), daemon=True)
        thread.start()
        w.write(b"  0%|          | 0/10")
        assert console.got.wait(30), "the first update never reached the console"
        w.write(b"\r 10%|#         | 1/10")
        _wait_for(lambda: b"1/10" in console.data, 30, "the second update")
        w.write(b"\r100%|##########| 10/10\n")
        w.close()
        thread.join(30)
    assert bytes(console.data) == b"[rank0]:   0%|          | 0/10\r[rank0]:  10%|#         | 1/10\r[rank0]: 100%|##########| 10/10\n"
    assert (tmp_path / "stderr.log").read_bytes() == b"  0%|          | 0/10\r 10%|#         | 1/10\r100%|##########| 10/10\n"


def test_a_line_written_in_two_flushes_reaches_the_console_whole():
    """A worker's stdout into a pipe is flushed in 8 KiB blocks, which cut lines: the console gets each
    line in one write, so two ranks' lines never mix mid-line (only a line left unfinished for
    PARTIAL_LINE_S is forwarded as is)."""
    from spmd.launch.workers import _Sink

    writes: list[bytes] = []

    class Recording(_Console):
        def write(self, data):
            writes.append(bytes(data))
            return super().write(data)

    read, write = os.pipe()
    sink = _Sink(Recording(), b"[rank1]: ", None, None)
    with os.fdopen(read, "rb") as r, os.fdopen(write, "wb", buffering=0) as w:
        thread = threading.Thread(target=sink.pump, args=(r,), daemon=True)
        thread.start()
        w.write(b"step 1 loss 0.5\nstep 2 lo")  # a block flushed in the middle of a line
        time.sleep(0.02)
        w.write(b"ss 0.4\n")
        w.close()
        thread.join(30)
    assert b"".join(writes) == b"[rank1]: step 1 loss 0.5\n[rank1]: step 2 loss 0.4\n"
    assert all(chunk.endswith(b"\n") for chunk in writes), writes


def test_a_huge_line_without_newline_is_not_kept_whole_for_the_summary(tmp_path):
    """A worker writes 1 MiB with no newline, then fails: the log file gets it all, the tail kept for the failure
    summary only each line's end (the whole 'line' was held, twice, and went into the summary)."""
    import collections

    from spmd.launch.workers import TAIL_LINE_BYTES, _last_traceback, _Sink

    tail: collections.deque = collections.deque(maxlen=40)
    blob = b"x" * (1 << 20)
    read, write = os.pipe()
    with os.fdopen(write, "wb") as w:
        threading.Thread(target=lambda: (w.write(blob + b"\nTraceback (most recent call last):\nValueError: boom\n"), w.close()), daemon=True).start()
        with os.fdopen(read, "rb") as r, open(tmp_path / "stderr.log", "wb") as log:
            _Sink(None, b"", log, tail).pump(r)
    assert (tmp_path / "stderr.log").stat().st_size == len(blob) + 53
    assert [len(line) for line in tail] == [TAIL_LINE_BYTES, 34, 16]
    assert _last_traceback(list(tail)) == "Traceback (most recent call last):\nValueError: boom"


class _Chunks(io.RawIOBase):
    """A stream that yields the given chunks, one per read."""

    def __init__(self, chunks):
        self.chunks = list(chunks)

    def readable(self):
        return True

    def readinto(self, buffer):
        if not self.chunks:
            return 0
        chunk = self.chunks.pop(0)
        buffer[: len(chunk)] = chunk
        return len(chunk)


def test_tee_prefixes_line_starts_however_the_output_is_cut_into_chunks():
    """A line that already carries the prefix (torch's excepthook) is recognised even when a read ends inside it."""
    from spmd.launch.workers import _Sink

    text = b"[rank0]: Traceback (most recent call last):\n\nplain [rank0]: \r\nbar 1\rbar 2\r[rank0]: x\n[rank"
    expected = b"[rank0]: Traceback (most recent call last):\n[rank0]: \n[rank0]: plain [rank0]: \r\n[rank0]: bar 1\r[rank0]: bar 2\r[rank0]: x\n[rank0]: [rank"
    for size in (1, 2, 3, 5, 8, 9, 10, len(text)):
        console = _Console()
        stream = io.BufferedReader(_Chunks(text[i:i + size] for i in range(0, len(text), size)))
        _Sink(console, b"[rank0]: ", None, None).pump(stream)
        assert bytes(console.data) == expected, size
