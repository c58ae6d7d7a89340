"""A single-node job's store listens on loopback only: nothing off the machine can reach its keys."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as tdist

from spmd.comm.tcp_store import host_tcp_store
from spmd.testing.ports import free_port


def _outside_address() -> str:
    """An address of this machine that is not loopback (what another host would connect to)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
            address = s.getsockname()[0]
        except OSError:
            address = ""
    if not address or address.startswith("127."):
        pytest.skip("this machine has no non-loopback IPv4 address to connect from")
    return address


def _reachable(host: str, port: int) -> bool:
    try:
        client = tdist.TCPStore(host, port, None, False, timedelta(seconds=2))
        client.set("probe", "x")
        return True
    except Exception:  # noqa: BLE001 - any failure to connect is the point
        return False


def test_a_loopback_store_refuses_connections_from_the_machines_other_addresses():
    store = host_tcp_store("127.0.0.1", 0, None, timedelta(seconds=10), wait_for_workers=False)
    store.set("secret", "job data")
    assert _reachable("127.0.0.1", store.port)
    assert not _reachable(_outside_address(), store.port)
    assert store.get("secret") == b"job data"  # nothing was written or deleted from outside


SCRIPT = textwrap.dedent(
    """
    import os, socket, sys
    from datetime import timedelta
    import torch.distributed as tdist
    import spmd

    spmd.init()
    outside = sys.argv[1]
    endpoints = {os.environ["SPMD_AGENT_STORE"]}  # the agent's store: what the ranks and agents share
    results = []
    for endpoint in endpoints:
        host, _, port = endpoint.rpartition(":")
        try:
            tdist.TCPStore(outside, int(port), None, False, timedelta(seconds=2)).set("probe", "x")
            results.append(f"{endpoint}: reachable from {outside}")
        except Exception:
            results.append(f"{endpoint}: refused from {outside}")
    print("RESULT", results, flush=True)
    spmd.destroy_process_group()
    """
)


def test_spmd_run_single_node_store_is_not_reachable_from_outside(tmp_path):
    outside = _outside_address()
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    out = subprocess.run(
        [sys.executable, "-m", "spmd", "run", "--nproc-per-node", "1", str(script), outside],
        capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr
    line = next(line for line in out.stdout.splitlines() if line.startswith("RESULT"))
    assert "refused" in line and "reachable" not in line.replace("refused", ""), line


TOKEN_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    from datetime import timedelta
    import torch, torch.distributed as tdist
    import spmd
    from spmd.comm.tcp_store import job_scope

    spmd.init("gloo")
    outside, port, token = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    intruder = tdist.TCPStore(outside, port, None, False, timedelta(seconds=5))  # knows the job id, not the token
    known = ["rdzv/job7//round", "spmd/job/job7/round0/spmd/arrived/0"]
    seen = {key: intruder.check([key]) for key in known}
    intruder.set("rdzv/job7//shutdown", "stopped by an intruder")  # what `spmd run`'s agents obey
    time.sleep(1.0)  # a few of the agent's monitor intervals
    spmd.all_reduce(torch.ones(1))
    scoped = {key: job_scope(intruder, token).check([key]) for key in known} if token != "-" else {}
    print("RESULT", seen, scoped, flush=True)
    spmd.destroy_process_group()
    """
)


def _run_job(args: list[str], env: dict[str, str], logs: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``spmd run`` in its own session; on a hang, stop the whole tree and fail with what it printed."""
    out_path, err_path = logs / "stdout", logs / "stderr"
    with out_path.open("w") as out, err_path.open("w") as err:
        process = subprocess.Popen(args, stdout=out, stderr=err, text=True, env=env, start_new_session=True)
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # the agent and every worker: nothing lingers on a port
            process.wait()
            pytest.fail(f"the job did not finish within {timeout:.0f} s\nstdout:\n{out_path.read_text()}\nstderr:\n{err_path.read_text()}")
    return subprocess.CompletedProcess(args, code, out_path.read_text(), err_path.read_text())


@pytest.mark.parametrize("token", ["s3cret", None])
def test_a_job_token_hides_the_stores_keys_from_a_client_without_it(tmp_path, token):
    outside = _outside_address()
    script = tmp_path / "intruder.py"
    script.write_text(TOKEN_SCRIPT)
    flags = ["--rdzv-token", token] if token else []
    env = {k: v for k, v in os.environ.items() if k != "SPMD_RDZV_TOKEN"}
    for _attempt in range(3):  # the port is free when picked; another process may take it before the agent binds
        port = free_port(outside)  # (outside the ephemeral range: no outgoing connection is handed it meanwhile)
        out = _run_job(
            [sys.executable, "-m", "spmd", "run", "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-endpoint", f"{outside}:{port}",
             "--rdzv-id", "job7", *flags, str(script), outside, str(port), token or "-"],
            {**env, "OMP_NUM_THREADS": "1"}, tmp_path, timeout=120,
        )
        if "could not host the rendezvous store" not in out.stderr:
            break
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT")), None)
    if token:  # the intruder names no key, and its shutdown request is not the job's: it runs to the end
        assert out.returncode == 0, out.stderr
        assert line == "RESULT {'rdzv/job7//round': False, 'spmd/job/job7/round0/spmd/arrived/0': False} " \
                       "{'rdzv/job7//round': True, 'spmd/job/job7/round0/spmd/arrived/0': True}", out.stdout
    else:  # the control: without a token the same client reads the keys and stops the job
        assert line is None or "'rdzv/job7//round': True" in line, out.stdout
        assert out.returncode != 0 and "stopped by an intruder" in out.stderr, (out.stdout, out.stderr)
