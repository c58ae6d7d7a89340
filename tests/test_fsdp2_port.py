"""pytorch/examples' distributed/FSDP2 example (examples/ports/fsdp2_*.py) on spmd with only its import lines
changed: meta init, fully_shard per block then the root, bf16 MixedPrecisionPolicy, explicit prefetching, and
its checkpoints in both forms, against the same script on torch.

Torch's CPU DTensor draws each shard of ``reset_parameters()`` from its own rank's generator and spmd's draws
the full tensor (docs/fsdp.md), so the two libraries start from different weights. The comparisons therefore
start both from one checkpoint; the example's checkpoints are ``torch.save``d full state dicts of plain tensors
(it never calls ``dcp.save``), so one library's file loads in the other: the ``dtensor_api`` start is torch's,
the ``dcp_api`` start is spmd's. spmd's fresh start is checked against the one-process initialisation instead.
"""

from __future__ import annotations

import hashlib
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch
from test_ports import PORTS, TORCHRUN, launch, torch_version

SPMD_RUN = [sys.executable, "-m", "spmd", "run"]
PORTED = ["fsdp2_example.py", "fsdp2_checkpoint.py", "fsdp2_utils.py"]  # files with "# port:" lines
PLAIN = ["fsdp2_model.py"]  # no torch.distributed import: the same file on both sides


@pytest.fixture(scope="module")
def torch_script(tmp_path_factory) -> Path:
    into = tmp_path_factory.mktemp("torch_fsdp2")
    for name in PORTED:
        torch_version(PORTS / name, into)
    for name in PLAIN:
        shutil.copy(PORTS / name, into)
    return into / "fsdp2_example.py"


def run(script: Path, ckpt: Path, *flags: str, steps: int) -> dict:
    """One 2-rank run; both ranks train on the same batches (as the original), so they report the same."""
    torch_side = not script.is_relative_to(PORTS)
    launcher = [str(TORCHRUN)] if torch_side else SPMD_RUN
    rows, _ = launch(script, "torchrun", [*flags, "--steps", str(steps), "--ckpt-dir", str(ckpt)], launcher, reference=torch_side)
    assert rows[0]["lib"] == ("torch" if torch_side else "spmd")
    assert {k: v for k, v in rows[0].items() if k != "rank"} == {k: v for k, v in rows[1].items() if k != "rank"}
    return rows[0]


def saved(ckpt: Path) -> list[Path]:
    return sorted(p for p in ckpt.glob("*_api/*") if p.is_dir())


def agree(a: float, b: float) -> bool:
    """To 1e-5. fp32 runs agree exactly (measured); the bf16 ``--mixed-precision`` run does not: its third loss
    was -5988.015625 on spmd and -5988.056640625 on torch (7e-6 relative), while torch repeats its own bit for
    bit from the same checkpoint. The cause is not found yet (gradient reduction and the optimizer step agree
    exactly in fp32), so the bf16 case holds spmd to 1e-5, not to torch's zero run-to-run noise."""
    return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-5)


#: case -> (flags, who writes the starting checkpoint)
CASES = {
    "default": ([], "torch"),
    "mixed-precision": (["--mixed-precision"], "torch"),
    "explicit-prefetching": (["--explicit-prefetching"], "torch"),
    "dcp-api": (["--dcp-api"], "spmd"),
}


@pytest.fixture(scope="module")
def starts(torch_script, tmp_path_factory) -> dict[str, Path]:
    """One step from a fresh start, saved: dtensor_api by torch, dcp_api by spmd (plain torch.save files)."""
    out = {}
    for api, script, flags in (("dtensor", torch_script, []), ("dcp", PORTS / "fsdp2_example.py", ["--dcp-api"])):
        ckpt = tmp_path_factory.mktemp(f"start_{api}")
        run(script, ckpt, *flags, steps=1)
        assert len(saved(ckpt)) == 1
        out[api] = ckpt
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_fsdp2_example_resumed_from_one_checkpoint_agrees_with_torch(case, starts, torch_script, tmp_path):
    flags, _ = CASES[case]
    start = starts["dcp" if "--dcp-api" in flags else "dtensor"]
    ours_dir, theirs_dir = tmp_path / "spmd", tmp_path / "torch"
    shutil.copytree(start, ours_dir)
    shutil.copytree(start, theirs_dir)
    ours = run(PORTS / "fsdp2_example.py", ours_dir, *flags, steps=3)
    theirs = run(torch_script, theirs_dir, *flags, steps=3)
    for row in (ours, theirs):
        assert row["resumed"] and row["start"] == 1 and len(row["losses"]) == 3
    assert ours["initial"]["sha"] == theirs["initial"]["sha"]  # both loaded the same weights, bit for bit
    diffs = [abs(a - b) for a, b in zip(ours["losses"], theirs["losses"])]
    print(f"\n{case}: spmd {ours['losses']}\n{case}: torch {theirs['losses']}\n{case}: max abs diff {max(diffs)}")
    assert all(agree(a, b) for a, b in zip(ours["losses"], theirs["losses"])), (max(diffs), ours["losses"], theirs["losses"])
    for key in ("sum", "sq"):
        assert agree(ours["final"][key], theirs["final"][key]), (key, ours["final"], theirs["final"])
    assert len(saved(ours_dir)) == 2  # the example saved again at the end


def one_process_init_sha() -> str:
    """spmd's reset_parameters() on the sharded meta model draws what one process draws (docs/fsdp.md)."""
    sys.path.insert(0, str(PORTS))
    try:
        from fsdp2_model import ModelArgs, Transformer
    finally:
        sys.path.remove(str(PORTS))
    with torch.device("meta"):
        model = Transformer(ModelArgs(n_layers=2, n_heads=4, vocab_size=96, max_seq_len=16, dim=32, dropout_p=0))
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.reset_parameters()
    sha = hashlib.sha256()
    full = model.state_dict()
    for name in sorted(full):
        sha.update(name.encode())
        sha.update(full[name].detach().float().contiguous().numpy().tobytes())
    return sha.hexdigest()


@pytest.mark.parametrize("flags", [[], ["--dcp-api"]], ids=["dtensor_api", "dcp_api"])
def test_fsdp2_example_saved_and_resumed_on_spmd_equals_an_uninterrupted_run(flags, tmp_path):
    """The example's save then load (on spmd both times) loses nothing: 2 steps + 2 steps == 4 steps."""
    whole = run(PORTS / "fsdp2_example.py", tmp_path / "whole", *flags, steps=4)
    assert not whole["resumed"] and whole["initial"]["sha"] == one_process_init_sha()
    first = run(PORTS / "fsdp2_example.py", tmp_path / "parts", *flags, steps=2)
    second = run(PORTS / "fsdp2_example.py", tmp_path / "parts", *flags, steps=2)
    assert second["resumed"] and second["start"] == 2
    assert second["initial"]["sha"] == first["final"]["sha"]
    assert first["losses"] + second["losses"] == whole["losses"]
    assert second["final"]["sha"] == whole["final"]["sha"]
