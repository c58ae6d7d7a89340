"""spmd.integrations.ray on a local Ray cluster: the main job's loss curve, a named failure, a restart that resumes."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'spmd[ray]' (part of the dev extra)")

import torch  # noqa: E402
from launch_helpers import clean_env  # noqa: E402
from train_runs import SMALL, losses  # noqa: E402

import spmd  # noqa: E402
from spmd.errors import WorkerFailedError, WorkerTimeoutError  # noqa: E402
from spmd.integrations import ray as spmd_ray  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
STEPS = 4


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    """One light local cluster for the module: two CPUs, no dashboard; workers import this file and the examples."""
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "tests"), str(EXAMPLES), saved) if p)
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 << 20, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    try:
        yield
    finally:
        ray.shutdown()
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


def test_main_job_on_two_ray_workers_has_spmd_runs_loss_curve(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import train_ray  # the workers import it by name too (PYTHONPATH)

    monkeypatch.delitem(sys.modules, "train_ray")  # a generic name: leave no trace for other tests

    argv = ["--steps", str(STEPS), *SMALL, "--out", str(tmp_path / "ray.pt")]
    results = spmd_ray.run(train_ray.train_fn, {"argv": argv, "examples": str(EXAMPLES)}, num_workers=2, backend="gloo")
    assert [r["rank"] for r in results] == [0, 1]

    run = subprocess.run([sys.executable, "-m", "spmd", "run", "--nproc-per-node", "2", str(EXAMPLES / "train.py"),
                          *argv[:-1], str(tmp_path / "run.pt")], env=clean_env(OMP_NUM_THREADS="1"),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    printed = losses([line.split("lr")[0] for line in run.stdout.splitlines() if line.startswith("step")])
    on_ray = [results[0]["losses"][step] for step in range(STEPS)]
    assert len(printed) == STEPS and printed == pytest.approx(on_ray, abs=1e-4)  # printed to 4 decimals
    assert results[1]["losses"] != results[0]["losses"]  # each rank trained on its own shard
    a, b = torch.load(tmp_path / "ray.pt"), torch.load(tmp_path / "run.pt")
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-4) for k in a if not k.endswith(".k.bias"))


def _rank_one_raises(config: dict) -> int:
    if int(os.environ["RANK"]) == 1:
        raise ValueError("bad batch on purpose")
    return 0


def test_a_worker_that_raises_is_named_by_rank():
    with pytest.raises(WorkerFailedError, match=r"rank 1 of 2 .*raised ValueError: bad batch on purpose") as info:
        spmd_ray.run(_rank_one_raises, num_workers=2)
    assert info.value.rank == 1


def _killed_once_then_resumes(config: dict) -> dict:
    """Counts to 6 with an all-reduce per step, saving the step; rank 1 is SIGKILLed at step 3 of the first attempt."""
    spmd.init()  # from the rank environment, unchanged
    rank, ckpt = spmd.get_rank(), pathlib.Path(config["dir"]) / "step"
    start = int(ckpt.read_text()) if ckpt.exists() else 0
    total = torch.zeros(1)
    for step in range(start, 6):
        t = torch.tensor([float(step)])
        spmd.all_reduce(t)
        total += t
        if rank == 0:
            ckpt.write_text(str(step + 1))
        spmd.barrier()
        if step == 3 and rank == 1 and os.environ["SPMD_RESTART_COUNT"] == "0":
            os.kill(os.getpid(), signal.SIGKILL)
    spmd.destroy_process_group()
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "SPMD_RESTART_COUNT")
    return {"start": start, "total": total.item(), **{k: os.environ[k] for k in keys}}


def test_a_killed_worker_restarts_the_group_which_resumes(tmp_path, caplog):
    results = spmd_ray.run(_killed_once_then_resumes, {"dir": str(tmp_path)}, num_workers=2, max_restarts=1)
    died = [r.getMessage() for r in caplog.records if "restarting the group" in r.getMessage()]
    assert len(died) == 1 and "rank 1 of 2" in died[0] and "attempt 0) died" in died[0], died
    assert [r["start"] for r in results] == [4, 4]  # resumed after the last step saved before the kill
    assert [r["total"] for r in results] == [2 * (4 + 5)] * 2
    # torchrun's variables, which spmd.init() joined from
    assert [r["RANK"] for r in results] == ["0", "1"] and [r["LOCAL_RANK"] for r in results] == ["0", "1"]
    assert {(r["WORLD_SIZE"], r["LOCAL_WORLD_SIZE"], r["NODE_RANK"], r["SPMD_RESTART_COUNT"]) for r in results} == {
        ("2", "2", "0", "1")}
    assert {r["MASTER_ADDR"] for r in results} == {ray.util.get_node_ip_address()}


def test_workers_that_cannot_be_placed_are_a_named_error():
    with pytest.raises(WorkerTimeoutError, match=r"could not place 3 workers .*within 1 s"):
        spmd_ray.run(_rank_one_raises, num_workers=3, start_timeout=1)
