"""examples/train.py runs as a 2-rank job from torchrun-style variables and saves a loadable state dict."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_train_example_on_two_ranks(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "final.pt"
    args = ["--steps", "4", "--d-model", "32", "--layers", "1", "--heads", "2", "--batch-size", "4",
            "--corpus-chars", "20000", "--out", str(out), "--log-every", "1"]
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, str(ROOT / "examples" / "train.py"), *args], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(2)
    ]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert "world 2" in outputs[0] and "step     3  loss" in outputs[0] and "tok/s" in outputs[0]
    assert "step" not in outputs[1]  # only rank 0 reports

    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from model import CharGPT, GPTConfig
    finally:
        sys.path.remove(str(ROOT / "examples"))
        sys.modules.pop("model", None)  # a generic name: leave no trace for other tests
    state = torch.load(out)
    model = CharGPT(GPTConfig(vocab_size=state["tok.weight"].shape[0], d_model=32, n_layers=1, n_heads=2))
    model.load_state_dict(state)  # plain keys, no "module." prefix
