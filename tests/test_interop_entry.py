"""Which side starts first: torch.distributed before spmd, spmd alone, or spmd told to leave torch alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spmd.testing.ports import free_port

SCRIPTS = Path(__file__).parent / "interop_scripts"
SPMD = [sys.executable, "-m", "spmd"]


def run(script: str, *args: str, **env: str) -> list[dict]:
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    clean.update(env)
    out = subprocess.run([*SPMD, "run", "--nproc-per-node", "2", str(SCRIPTS / script), *args], env=clean, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [json.loads(line.split("REPORT ", 1)[1]) for line in out.stdout.splitlines() if "REPORT " in line]
    assert len(rows) == 2, out.stdout
    return rows


@pytest.mark.parametrize("backend", ["gloo", "spmd"])
def test_spmd_joins_a_torch_distributed_initialised_first(backend):
    rows = run("torch_first.py", backend)
    for row in rows:
        assert row["spmd"] == row["torch"] and row["torch"][1] == 2
        assert row["backend"] == backend and row["sums"] == [3.0, 3.0]
    assert sorted(r["spmd"][0] for r in rows) == [0, 1]


@pytest.mark.parametrize("how", ["kwarg", "env"])
def test_torch_interop_can_be_turned_off(how):
    rows = run("opt_out.py", how, **({"SPMD_TORCH_INTEROP": "0"} if how == "env" else {}))
    assert [r["torch_initialized"] for r in rows] == [False, False]


def test_rank_and_world_size_without_a_master_fail_at_once():
    """torch's env:// pattern without MASTER_ADDR/MASTER_PORT: a clear error, not a wait for the timeout."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    code = "import spmd; spmd.init_process_group('gloo', rank=0, world_size=2)"
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "MASTER_ADDR" in out.stderr and "MASTER_PORT" in out.stderr
    assert time.monotonic() - started < 60  # start-up only; it used to wait out the 600 s timeout


def test_rank_and_world_size_read_the_master_from_the_environment():
    port = str(free_port())
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    code = (
        "import sys, torch, spmd; r = int(sys.argv[1]); spmd.init_process_group('gloo', rank=r, world_size=2); "
        "t = torch.ones(1); spmd.all_reduce(t); print('SUM', t.item())"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outs]
    assert all("SUM 2.0" in o[0] for o in outs)


def test_torch_destroy_ends_a_world_torch_started_so_the_next_init_is_new():
    """init_process_group("spmd"), destroy_process_group(), init_process_group("spmd") again with another store and
    timeout: the second world is a new one (it silently kept the first's store, timeout and ranks)."""
    code = (
        "from datetime import timedelta; import torch, torch.distributed as tdist, spmd; from spmd.comm import state\n"
        "tdist.init_process_group('spmd', store=tdist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=100))\n"
        "first = state.get_state().world\n"
        "tdist.destroy_process_group()\n"
        "assert not spmd.is_initialized()\n"
        "tdist.init_process_group('spmd', store=tdist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=7))\n"
        "second = state.get_state().world\n"
        "assert second is not first and second.timeout_s == 7.0, (first, second, second.timeout_s)\n"
        "t = torch.ones(2); tdist.all_reduce(t); assert t.tolist() == [1.0, 1.0]\n"
        "tdist.destroy_process_group(); print('OK')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "SPMD_WATCHDOG": "0"}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "OK", out.stdout + out.stderr


def test_a_world_torch_started_without_a_timeout_takes_spmds_default():
    """init_process_group("spmd") with no timeout: the world waits SPMD_TIMEOUT (else spmd's 10 minutes),
    not the 30 minutes torch fills in for a backend it does not know."""
    code = (
        "import torch.distributed as tdist; from spmd.comm import state\n"
        "tdist.init_process_group('spmd', store=tdist.HashStore(), rank=0, world_size=1)\n"
        "print(state.get_state().world.timeout_s); tdist.destroy_process_group()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "SPMD_WATCHDOG": "0", "SPMD_TIMEOUT": "42"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "42.0", out.stdout + out.stderr


def test_fully_shard_joins_the_world_torch_distributed_made():
    """Only torch.distributed.init_process_group was called: fully_shard used to raise NotInitializedError."""
    rows = run("fully_shard_joins.py")
    for row in rows:
        assert row["spmd"] == row["torch"] and row["torch"][1] == 2 and row["local_rows"] == 2
    assert sorted(r["spmd"][0] for r in rows) == [0, 1]
    assert rows[0]["grad_sum"] == rows[1]["grad_sum"]
