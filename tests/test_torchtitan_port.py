"""torchtitan's ``apply_tp`` and ``apply_fsdp`` on its Llama 3 debug model (examples/ports/torchtitan, from
pytorch/torchtitan at commit 95d6d4f1, torchtitan/models/llama/{model,parallelize_llama}.py), on spmd with
only the import lines changed: one forward and one backward under TP=2, FSDP=2 and TP2 x FSDP2, against the
same files on torch and against a one-process run with no parallelism (loss and full-gradient norms to 1e-5,
relative).

The torch.distributed imports of the ported file, each mapped to spmd's module at the same path:

- ``torch.distributed.device_mesh.DeviceMesh`` -> ``spmd.device_mesh.DeviceMesh``
- ``torch.distributed.fsdp.{CPUOffloadPolicy, fully_shard, MixedPrecisionPolicy}`` -> ``spmd.fsdp``
- ``torch.distributed.tensor.{Replicate, Shard}`` -> ``spmd.tensor``
- ``torch.distributed.tensor.parallel.{ColwiseParallel, parallelize_module, PrepareModuleInput,
  RowwiseParallel, SequenceParallel}`` -> ``spmd.tensor.parallel``

Torch-private modules: at this commit ``apply_tp`` and ``apply_fsdp`` import none at module level. The file's
two private imports belong to the functions left out of the port, and went with them:
``torch.distributed._composable.replicate`` (``apply_ddp``) and
``torch.distributed.algorithms._checkpoint.checkpoint_wrapper`` (``apply_ac``). One private import is
left as torch's, not mapped: ``torch.distributed._symmetric_memory.enable_symm_mem_for_group``, imported
lazily inside ``apply_tp``'s async-TP branch (CUDA symmetric memory with torch.compile; spmd has no
counterpart). The driver passes ``enable_async_tp=False``, so neither side reaches that line.

The driver is run_parallelize.py (its own ``# port:`` lines: ``torch.distributed`` as ``dist``,
``init_device_mesh``, ``DTensor``). The older commit is used because torchtitan's newest llama3 spreads
these functions over torchtitan.distributed and a shared decoder. Each launch takes 5-17 s on an idle two-core
machine (the four-rank ones the longest), the file about a minute (90 s of CPU time; 3.5 minutes measured at a load
average of 10-20).
"""

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
from test_ports import PORTS, TORCHRUN, launch, torch_version

TITAN = PORTS / "torchtitan"
DRIVER = "run_parallelize.py"
PORTED = (DRIVER, "parallelize_llama.py")  # files with "# port:" lines
PLAIN = ("model.py",)  # no torch.distributed import: the same file on both sides
SPMD_RUN = [sys.executable, "-m", "spmd", "run"]
#: --mode -> ranks
MODES = {"tp": 2, "fsdp": 2, "tp_fsdp": 4}


def imports(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if re.match(r"\s*(import|from) ", line)]


@pytest.fixture(scope="module")
def torch_dir(tmp_path_factory) -> Path:
    into = tmp_path_factory.mktemp("torch_titan")
    for name in PORTED:
        torch_version(TITAN / name, into)
        assert not any("spmd" in line for line in imports(into / name)), name
    for name in PLAIN:
        assert not any("torch.distributed" in line for line in imports(TITAN / name)), f"{name} would need port lines"
        shutil.copy(TITAN / name, into / name)
    return into


@pytest.fixture(scope="module")
def reference() -> dict:
    """The one-process run: the same model and batch, no parallelism."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, str(TITAN / DRIVER), "--mode", "none"], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    (row,) = [json.loads(line.removeprefix("RESULT ")) for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    return row


@pytest.fixture(scope="module")
def runs(torch_dir):
    """``runs(mode)`` -> (spmd's rows, torch's rows), each launched once per module."""
    done: dict[str, tuple[list[dict], list[dict]]] = {}

    def run(mode: str) -> tuple[list[dict], list[dict]]:
        if mode not in done:
            nproc = MODES[mode]
            ours, _ = launch(TITAN / DRIVER, "torchrun", ["--mode", mode], SPMD_RUN, nproc=nproc)
            theirs, _ = launch(torch_dir / DRIVER, "torchrun", ["--mode", mode], [str(TORCHRUN)], reference=True, nproc=nproc)
            done[mode] = (ours, theirs)
        return done[mode]

    return run


def numbers(row: dict) -> dict[str, float]:
    """The row's loss and gradient norms, by name."""
    return {"loss": row["loss"], "total_grad_norm": row["total_grad_norm"], **row["grad_norms"]}


def relative_drift(row: dict, expected: dict) -> dict[str, float]:
    """Each number's relative distance from ``expected``'s (the same names, or a KeyError)."""
    a, b = numbers(row), numbers(expected)
    assert a.keys() == b.keys()
    return {k: abs(a[k] - b[k]) / abs(b[k]) for k in b}


def assert_agrees(side: str, rows: list[dict], expected: dict, against: str) -> None:
    for row in rows:
        drift = relative_drift(row, expected)
        assert all(d <= 1e-5 for d in drift.values()), (
            f"{side} rank {row['rank']} is off {against} by {max(drift.values()):.3g} (relative): "
            f"{ {k: d for k, d in drift.items() if d > 1e-5} }\n{side}: {numbers(row)}\n{against}: {numbers(expected)}"
        )


@pytest.mark.parametrize("mode", sorted(MODES))
def test_torchtitan_parallelize_agrees_with_torch_and_the_one_process_run(mode, runs, reference):
    ours, theirs = runs(mode)
    assert [r["rank"] for r in ours] == [r["rank"] for r in theirs] == list(range(MODES[mode]))
    # the parallelism was applied, and laid the parameters out as torch's did
    assert reference["dtensor_params"] == 0
    for side_ours, side_theirs in zip(ours, theirs, strict=True):
        assert side_ours["dtensor_params"] == side_theirs["dtensor_params"] > 0
        assert side_ours["wq_local_shape"] == side_theirs["wq_local_shape"]
        full = math.prod(reference["wq_local_shape"])
        assert math.prod(side_ours["wq_local_shape"]) == full // MODES[mode]
    assert_agrees("spmd", ours, theirs[0], "torch rank 0")
    assert_agrees("torch", theirs, reference, "the one-process run")
    assert_agrees("spmd", ours, reference, "the one-process run")
