"""Start-up faults end in an error that names the cause, within the timeout, on every rank that came.

Each case starts real ``spmd.init`` processes with SPMD_TIMEOUT=5; the child
measures its own ``spmd.init`` (interpreter and torch start-up excluded, which
take seconds on a loaded 2-core host) and prints the error's last line.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

TIMEOUT_S = 5
CHILD = """
import sys, time
import spmd
start = time.monotonic()
try:
    spmd.init("gloo")
except Exception as error:
    print(f"ELAPSED {time.monotonic() - start:.2f}")
    print(f"ERROR {type(error).__name__}: {error}")
    sys.exit(3)
print("JOINED")
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(rank: int, world: int, addr: str, port: int) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("SPMD_AGENT_STORE", "TORCHELASTIC_USE_AGENT_STORE")}
    env.update({"MASTER_ADDR": addr, "MASTER_PORT": str(port), "WORLD_SIZE": str(world), "RANK": str(rank),
                "LOCAL_RANK": str(rank), "SPMD_TIMEOUT": str(TIMEOUT_S), "OMP_NUM_THREADS": "1"})
    return subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _outcome(proc: subprocess.Popen) -> tuple[float, str]:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, (out, err)
    lines = out.splitlines()
    elapsed = float(next(line for line in lines if line.startswith("ELAPSED")).split()[1])
    return elapsed, next(line for line in lines if line.startswith("ERROR"))


def test_a_silent_listener_on_master_port_is_named_within_the_timeout():
    with socket.socket() as listener:  # accepts (the kernel's backlog) and never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        elapsed, error = _outcome(_start(1, 2, "127.0.0.1", listener.getsockname()[1]))
    assert "nothing answered there as a store" in error and "another program holds that port" in error, error
    assert elapsed < TIMEOUT_S + 2 + 3, elapsed  # the deadline is timeout + 2 s; 3 s for a loaded host


def test_an_unresolvable_master_addr_says_dns():
    elapsed, error = _outcome(_start(1, 2, "no-such-host.invalid", 29500))
    assert "MASTER_ADDR='no-such-host.invalid' does not resolve (DNS" in error, error
    assert elapsed < TIMEOUT_S + 3, elapsed


def test_nothing_listening_says_the_store_was_not_reached():
    elapsed, error = _outcome(_start(1, 2, "127.0.0.1", _free_port()))
    assert "nothing listens at 127.0.0.1" in error and "rank 0, which hosts the job's store there, has not started" in error, error
    assert elapsed < TIMEOUT_S + 2 + 3, elapsed


def test_the_probe_knows_a_real_store_a_silent_listener_and_an_empty_port():
    # The probe speaks a few bytes of TCPStore's protocol: if torch changes it, this fails here
    # (instead of spmd.init refusing real stores as silent listeners).
    from datetime import timedelta

    from spmd.comm.store_join import _probe
    from spmd.comm.tcp_store import host_tcp_store

    store = host_tcp_store("127.0.0.1", 0, None, timedelta(seconds=5), wait_for_workers=False)
    assert _probe("127.0.0.1", store.port, 5.0) == "store"
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        assert _probe("127.0.0.1", listener.getsockname()[1], 0.5) == "silent"
    assert _probe("127.0.0.1", _free_port(), 0.5) == "absent"


def test_world_size_larger_than_the_ranks_started_names_the_missing_on_every_rank():
    port = _free_port()
    procs = [_start(r, 3, "127.0.0.1", port) for r in range(2)]  # WORLD_SIZE=3, rank 2 never started
    for rank, proc in enumerate(procs):
        elapsed, error = _outcome(proc)
        assert f"rank {rank}: only 2 of WORLD_SIZE=3 ranks reached spmd.init" in error and "ranks [2] never arrived" in error, error
        assert elapsed < TIMEOUT_S + 2 + 3, elapsed


def test_master_port_in_use_on_rank_0_is_named():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        elapsed, error = _outcome(_start(0, 2, "127.0.0.1", holder.getsockname()[1]))
    assert "could not host the rendezvous store" in error and "Address already in use" in error, error


STORE_HOST_DIES = """
import os, signal, sys, time
import torch
import spmd
spmd.init("gloo")
spmd.all_reduce(torch.ones(4))
if spmd.get_rank() == 0:
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)  # rank 0 hosts the job's store
try:
    spmd.all_reduce(torch.ones(4))
except Exception as error:
    print(f"ERROR {type(error).__name__}: {error}")
    sys.exit(3)
"""


def test_the_store_hosts_death_is_named_as_rank_0():
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("SPMD_AGENT_STORE", "TORCHELASTIC_USE_AGENT_STORE")}
    env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "SPMD_TIMEOUT": "20", "OMP_NUM_THREADS": "1"})
    procs = [subprocess.Popen([sys.executable, "-c", STORE_HOST_DIES], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    out, err = procs[1].communicate(timeout=120)
    procs[0].communicate(timeout=60)
    assert procs[0].returncode == -9 and procs[1].returncode == 3, (out, err)
    assert "the job's store is unreachable" in out and f"it lives in rank 0's process (127.0.0.1:{port})" in out, out
