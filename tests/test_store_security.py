"""A single-node job's store listens on loopback only: nothing off the machine can reach its keys."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from datetime import timedelta

import pytest
import torch.distributed as tdist

from spmd.comm.tcp_store import host_tcp_store


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
