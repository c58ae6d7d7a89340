"""Run examples/train.py as N local ranks (torchrun's variables) and read rank 0's loss lines."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: A model and run small enough for a test on two cores.
SMALL = ["--d-model", "32", "--layers", "2", "--heads", "2", "--batch-size", "4", "--corpus-chars", "20000", "--log-every", "1"]


def run_train(world: int, extra: list[str], out: pathlib.Path, steps: int = 5, timeout: float = 300) -> list[str]:
    """examples/train.py on ``world`` ranks; rank 0's "step N  loss X" lines (the part before the lr)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["--steps", str(steps), *SMALL, "--out", str(out), *extra]
    env = {**os.environ, "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(ROOT / "examples" / "train.py"), *args],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(world)]
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * world, outputs
    return [line.split("lr")[0] for line in outputs[0].splitlines() if line.startswith("step")]


def losses(lines: list[str]) -> list[float]:
    return [float(line.split("loss")[1]) for line in lines]


def assert_same_state(path_a: pathlib.Path, path_b: pathlib.Path, atol: float = 1e-4) -> None:
    """Two runs' saved state dicts hold the same keys and values within ``atol``.

    Except the key projections' biases: their gradient is exactly zero (``q . b_k`` shifts every score
    of a query alike, which softmax ignores), so what they get is rounding noise, and AdamW turns any
    nonzero gradient into a step of up to about the learning rate (3e-3): they may drift apart by that
    much on another machine's arithmetic, never by more.
    """
    import torch

    a, b = torch.load(path_a), torch.load(path_b)
    assert a.keys() == b.keys() and all(type(v) is torch.Tensor for v in b.values())
    noise_only = {k for k in a if k.endswith(".k.bias")}
    worst = {k: (a[k] - b[k]).abs().max().item() for k in a}
    assert max(v for k, v in worst.items() if k not in noise_only) < atol, worst
    assert max((worst[k] for k in noise_only), default=0.0) < 5 * 3e-3, worst
