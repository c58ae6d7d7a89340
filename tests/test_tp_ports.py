"""pytorch/examples' distributed/tensor_parallelism scripts, ported (examples/ports): each runs on spmd with only
its import lines changed and prints the losses torch prints; fsdp_tp_example's losses also match a one-process
run of the same model on the full batch (the regression guard for a 2-D run that drifted 0.09% after its first
step and 0.3% later, when DTensor dispatch dropped the conjugate bit of the rotary embeddings' complex tensors)."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_ports import PORTS, TORCHRUN, close, launch, torch_version

#: script -> ranks (the mesh of fsdp_tp_example is (dp, tp) = (2, 2))
SCRIPTS = {"tensor_parallel_example.py": 2, "sequence_parallel_example.py": 2, "fsdp_tp_example.py": 4}
#: modules the scripts import from their own folder (no torch.distributed import in them: copied as they are)
COMPANIONS = ("llama2_model.py", "log_utils.py")
SPMD_RUN = [sys.executable, "-m", "spmd", "run"]


def torch_script(name: str, into: Path) -> Path:
    """The torch version of ``name`` in ``into``, beside the modules it imports from examples/ports."""
    target = torch_version(PORTS / name, into)
    assert "import spmd" not in target.read_text() and "from spmd" not in target.read_text()
    for companion in COMPANIONS:
        imports = [line for line in (PORTS / companion).read_text().splitlines() if re.match(r"\s*(import|from) ", line)]
        assert not any("torch.distributed" in line for line in imports), f"{companion} would need port lines"
        shutil.copy(PORTS / companion, into / companion)
    return target


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(name)`` -> (spmd's rows, torch's rows), each script launched once per module."""
    done: dict[str, tuple[list[dict], list[dict]]] = {}

    def run(name: str) -> tuple[list[dict], list[dict]]:
        if name not in done:
            nproc = SCRIPTS[name]
            ours, _ = launch(PORTS / name, "torchrun", [], SPMD_RUN, nproc=nproc)
            torch_file = torch_script(name, tmp_path_factory.mktemp(name.removesuffix(".py")))
            theirs, _ = launch(torch_file, "torchrun", [], [str(TORCHRUN)], reference=True, nproc=nproc)
            done[name] = (ours, theirs)
        return done[name]

    return run


def max_abs_diff(ours: list[dict], theirs: list[dict]) -> float:
    return max(abs(a - b) for x, y in zip(ours, theirs, strict=True) for a, b in zip(x["losses"], y["losses"], strict=True))


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_tp_port_agrees_with_torch(name, runs):
    ours, theirs = runs(name)
    assert [r["rank"] for r in ours] == list(range(SCRIPTS[name]))
    assert all(len(set(r["losses"])) > 1 for r in ours), ours  # the model trains: every step's loss differs
    assert close(ours, theirs), f"max |spmd - torch| = {max_abs_diff(ours, theirs):.3g}\nspmd: {ours}\ntorch: {theirs}"


def reference_losses(dp_size: int) -> list[list[float]]:
    """tests/tp_ports_reference.py's losses: per data-parallel rank, per step, of the one-process run."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(PORTS), os.environ.get("PYTHONPATH", "")]))
    script = Path(__file__).with_name("tp_ports_reference.py")
    out = subprocess.run([sys.executable, str(script), str(dp_size)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])["losses"]


def test_fsdp_tp_port_matches_the_one_process_reference(runs):
    ours, theirs = runs("fsdp_tp_example.py")
    reference = reference_losses(dp_size=2)
    assert reference[0] != reference[1]  # the data-parallel ranks see different data
    for side, rows in (("spmd", ours), ("torch", theirs)):
        for r in rows:
            expected = reference[r["dp_rank"]]
            drift = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], expected, strict=True))
            assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(r["losses"], expected, strict=True)), (
                f"{side} rank {r['rank']} drifts {drift:.3g} (relative) from the one-process reference\n"
                f"{side}: {r['losses']}\nreference: {expected}"
            )
