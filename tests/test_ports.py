"""The five port patterns (examples/ports): each runs on spmd with only its import lines changed, and agrees with torch."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spmd.testing.ports import free_port

PORTS = Path(__file__).parent.parent / "examples" / "ports"
TORCHRUN = Path(sys.executable).parent / "torchrun"

#: script -> (how it is launched, its arguments)
CASES = {
    "multigpu_tutorial.py": ("python", []),
    "ddp_example.py": ("torchrun", ["--local-world-size", "2"]),
    "dist_tutorial.py": ("python", []),
    "torchrun_sampler.py": ("torchrun", []),
    "torchrun_objects.py": ("torchrun", []),
}


def torch_version(script: Path, into: Path) -> Path:
    """The script with every ``# port:`` line replaced by the torch line it names."""
    lines = []
    for line in script.read_text().splitlines():
        code, sep, original = line.partition("  # port: ")
        lines.append(original if sep else line)
    assert any("# port: " in line for line in script.read_text().splitlines()), f"{script.name} marks no ported line"
    target = into / script.name
    target.write_text("\n".join(lines) + "\n")
    return target


def result_rows(stdout: str) -> list[dict]:
    """Every rank's ``RESULT {json}``. The ranks share one pipe, and an unbuffered ``print`` writes
    its text and its newline apart, so another rank's output may follow a row on the same line."""
    decoder = json.JSONDecoder()
    return [decoder.raw_decode(chunk)[0] for chunk in stdout.split("RESULT ")[1:]]


#: torch's own Gloo can abort while a process exits, after the script finished and printed its results (seen
#: once in three loaded full runs, on rank 0 of the torch side of ddp_example.py after destroy_process_group)
TORCH_EXIT_ABORT = "terminate called without an active exception"


def launch(
    script: Path, how: str, args: list[str], launcher: list[str], reference: bool = False, nproc: int = 2
) -> tuple[list[dict], str]:
    """Run a port on ``nproc`` ranks and return each rank's RESULT row. The spmd side must exit 0; the torch reference
    (``reference``) may instead abort at exit in torch's own teardown once every rank has printed its row."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    port = str(free_port())
    if how == "python":
        env["MASTER_PORT"] = port  # the tutorials set MASTER_PORT only if the environment has none
        cmd = [sys.executable, str(script), *args]
    else:
        cmd = [*launcher, "--nproc-per-node", str(nproc), "--master-port", port, str(script), *args]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    rows = result_rows(out.stdout)
    aborted_at_exit = reference and len(rows) == nproc and TORCH_EXIT_ABORT in out.stdout + out.stderr
    assert out.returncode == 0 or aborted_at_exit, out.stdout + out.stderr
    assert len(rows) == nproc, out.stdout
    return sorted(rows, key=lambda r: r["rank"]), out.stdout + out.stderr


def close(a: object, b: object) -> bool:
    """Equal, with floats equal to 1e-5 (spmd's DDP averages in its own order)."""
    if isinstance(a, float) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize("name", sorted(CASES))
def test_port_runs_with_only_the_import_changed_and_agrees_with_torch(name, tmp_path):
    how, args = CASES[name]
    ours, log = launch(PORTS / name, how, args, [sys.executable, "-m", "spmd", "run"])
    theirs, _ = launch(torch_version(PORTS / name, tmp_path), how, args, [str(TORCHRUN)], reference=True)
    assert close(ours, theirs), f"spmd: {ours}\ntorch: {theirs}"
    assert "failed to bind" not in log


def test_a_port_under_torchrun_prints_no_store_bind_error():
    rows, log = launch(PORTS / "torchrun_sampler.py", "torchrun", [], [str(TORCHRUN)])
    assert [r["rank"] for r in rows] == [0, 1]
    assert "failed to bind" not in log and "TCPStore" not in log
