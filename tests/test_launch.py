"""`spmd run`: torchrun compatibility, multi-agent rendezvous, restarts, signals, logs, elastic joins."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launch_helpers import alive, clean_env, wait_for

from spmd.testing.ports import free_port

SCRIPTS = Path(__file__).parent / "launch_scripts"
EXAMPLES = Path(__file__).parent.parent / "examples"
SPMD = [sys.executable, "-m", "spmd"]


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


@pytest.mark.parametrize(("signum", "flags"), [(signal.SIGINT, []), (signal.SIGTERM, []), (signal.SIGHUP, []),
                                              (signal.SIGUSR1, ["--signals-to-handle", "SIGTERM,SIGUSR1"])])
def test_signal_to_the_agent_reaches_every_worker(tmp_path, signum, flags):
    """torchrun's default set (SIGTERM, SIGINT, SIGHUP, SIGQUIT) and what --signals-to-handle adds reach every
    worker's handler (a SIGHUP killed the agent, and with it the workers, before they could act)."""
    agent = subprocess.Popen([*SPMD, "run", "--nproc-per-node", "2", *flags, str(SCRIPTS / "sleeper.py"), str(tmp_path)],
                             env=clean_env(), stderr=subprocess.PIPE, text=True)
    wait_for(lambda: len(list(tmp_path.glob("pid*"))) == 2, 60, "both workers to start")
    pids = [int(p.read_text()) for p in tmp_path.glob("pid*")]
    agent.send_signal(signum)
    _, err = agent.communicate(timeout=30)
    assert agent.returncode == 128 + signum
    assert f"received {signal.Signals(signum).name}" in err
    wait_for(lambda: not any(alive(p) for p in pids), 10, "workers to exit")
    assert [(tmp_path / f"got{r}").read_text() for r in (0, 1)] == [signal.Signals(signum).name] * 2


def test_kill_9_of_the_agent_leaves_no_orphan(tmp_path):
    agent = subprocess.Popen([*SPMD, "run", "--nproc-per-node", "2", str(SCRIPTS / "sleeper.py"), str(tmp_path)], env=clean_env())
    wait_for(lambda: len(list(tmp_path.glob("pid*"))) == 2, 60, "both workers to start")
    pids = [int(p.read_text()) for p in tmp_path.glob("pid*")]
    agent.kill()
    agent.wait(timeout=10)
    wait_for(lambda: not any(alive(p) for p in pids), 10, "workers to die with their agent")


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
    wait_for(ckpt.exists, 60, "the first node to train alone")
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


@pytest.mark.parametrize("script", ["report.py", "spmd_report.py"])
def test_two_agents_across_network_namespaces(spmd_hosts, script):
    """Two nodes of the test bed (hostnames resolving to 127.0.1.1), no GLOO_SOCKET_IFNAME: Gloo binds where the store is reached."""
    node0, node1 = spmd_hosts(2).nodes
    port = free_port()
    base = [*SPMD, "run", "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", f"{node0.address}:{port}", "--rdzv-id", "netns"]
    env = {k: v for k, v in clean_env().items() if k not in ("GLOO_SOCKET_IFNAME", "SPMD_SOCKET_IFNAME")}
    agents = [
        node.popen([*base, "--node-rank", str(i), str(SCRIPTS / script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i, node in enumerate((node0, node1))
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
    wait_for(lambda: not any(alive(p) for p in helpers), 10, "both ranks' helpers to be stopped")
