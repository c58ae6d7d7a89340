"""spmd-nccl on a GPU machine, in one run: conformance, GPU behaviour, an all_reduce sweep against
torch's own NCCL process group, and a CUDA-graph capture. Started by run_gpu_checks.sh (read its
header for what to bring); it can also run on its own where spmd, spmd-gloo and spmd-nccl import.

    python benchmarks/gpu/run_gpu_checks.py --out DIR [--max-bytes N] [--ranks N] [--skip-conformance]

Ranks: one per visible GPU (``--ranks`` caps it). With a single GPU the sweep runs one rank: NCCL
then has no link to cross, so it measures per-call cost (Python and launch overhead against
torch's C++ path), not bandwidth. Every phase runs in a World of worker processes
(``spmd.testing.World``, backend ``cpu:gloo,cuda:nccl``) and is timed; a phase that fails is
reported and the others still run. Writes report.json and report.md to ``--out``; exits 1 if
any check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

BACKEND = "cpu:gloo,cuda:nccl"


class Worlds:
    """One live World per size; a World that failed or timed out is replaced on next use."""

    def __init__(self) -> None:
        self._worlds: dict[int, Any] = {}

    def get(self, n: int) -> Any:
        from spmd.testing.world import World

        world = self._worlds.get(n)
        if world is None or not world.alive:
            world = World(n, BACKEND, start_timeout=120)
            self._worlds[n] = world
        return world

    def close(self) -> None:
        for world in self._worlds.values():
            world.close()
        self._worlds.clear()


def _phase(report: dict[str, Any], name: str, fn: Callable[[], Any]) -> Any:
    print(f"\n== {name}", flush=True)
    start = time.perf_counter()
    entry: dict[str, Any] = {}
    try:
        entry["result"] = fn()
        entry["ok"] = True
    except BaseException as error:  # noqa: BLE001 - reported, the next phase still runs
        if isinstance(error, KeyboardInterrupt):
            raise
        entry["ok"] = False
        entry["error"] = f"{type(error).__name__}: {error}"
        entry["traceback"] = traceback.format_exc()
        print(entry["traceback"], flush=True)
    entry["seconds"] = round(time.perf_counter() - start, 2)
    report["phases"][name] = entry
    print(f"   {'ok' if entry['ok'] else 'FAILED'} in {entry['seconds']} s: {json.dumps(entry.get('result'), default=str)[:2000]}", flush=True)
    return entry.get("result")


def _conformance(worlds: Worlds, n: int, shapes: tuple[str, ...]) -> dict[str, list[str]]:
    """The shared conformance suite on CUDA tensors, then spmd-nccl's own checks."""
    from spmd.testing.conformance.checks import CHECKS
    from spmd.testing.conformance.suite import run_cases
    from spmd_nccl import gpu_checks

    runs = [(f"{op}/{shape}", run_cases, (op, shape, "cuda")) for shape in shapes for op in CHECKS]
    runs.append(("nccl-only", gpu_checks.run_nccl_checks, ()))
    failures: dict[str, list[str]] = {}
    for name, fn, args in runs:
        try:
            per_rank = worlds.get(n).run(fn, *args, timeout=300)
            found = [f"rank {r}: {f}" for r, fs in enumerate(per_rank) for f in fs]
        except AssertionError as error:  # RankFailure / WorldTimeout
            found = [f"{type(error).__name__}: {str(error)[:3000]}"]
        print(f"   {name}: {'ok' if not found else f'{len(found)} failures'}", flush=True)
        if found:
            failures[name] = found[:40]
    if failures:
        raise AssertionError(json.dumps(failures, indent=1)[:20000])
    return failures


def _torch_nccl_version() -> str | None:
    """The NCCL version torch was built with (None where torch has no NCCL)."""
    try:
        import torch.cuda.nccl

        version = torch.cuda.nccl.version()
    except (ImportError, AttributeError, RuntimeError):
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _sweep_table(rows: list[dict[str, float]]) -> str:
    lines = [
        "| bytes | spmd µs | torch NCCL µs | raw ncclAllReduce µs | spmd / torch | spmd busbw GB/s | torch busbw GB/s |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {int(r['bytes'])} | {r['spmd_us']:.1f} | {r['torch_us']:.1f} | {r['raw_us']:.1f} | "
            f"{r['spmd_over_torch']:.2f} | {r['spmd_busbw_GBps']:.2f} | {r['torch_busbw_GBps']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu_results")
    parser.add_argument("--max-bytes", type=int, default=1 << 30, help="largest all_reduce in the sweep (default 1 GiB)")
    parser.add_argument("--ranks", type=int, default=8, help="at most this many ranks (one per GPU)")
    parser.add_argument("--skip-conformance", action="store_true")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)

    import torch

    import spmd_nccl
    from spmd.testing.conformance import GROUP_SHAPES
    from spmd_nccl import gpu_checks

    if not torch.cuda.is_available():
        print("no CUDA device is visible to torch; nothing to check (see run_gpu_checks.sh)", file=sys.stderr)
        return 2
    gpus = torch.cuda.device_count()
    n = max(1, min(gpus, args.ranks))
    report: dict[str, Any] = {
        "env": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torch_cuda": torch.version.cuda,
            "torch_nccl": _torch_nccl_version(),
            "gpus": [torch.cuda.get_device_name(i) for i in range(gpus)],
            "spmd_nccl_library": spmd_nccl.library_summary(),
            "ranks": n,
        },
        "phases": {},
    }
    print(json.dumps(report["env"], indent=1), flush=True)
    worlds = Worlds()
    started = time.perf_counter()
    try:
        if not args.skip_conformance:
            _phase(report, "conformance, 1 rank", lambda: _conformance(worlds, 1, ("world",)))
        _phase(report, "stream semantics, 1 rank", lambda: worlds.get(1).run(gpu_checks.check_stream_semantics))
        _phase(report, "CUDA graph capture, 1 rank", lambda: worlds.get(1).run(gpu_checks.check_cuda_graph))
        _phase(report, "sub-groups, 1 rank", lambda: worlds.get(1).run(gpu_checks.check_split_origin))
        _phase(report, "kernel host-staging paths (known to fail until the kernel stages on the device)",
               lambda: worlds.get(1).run(gpu_checks.check_kernel_staging)[0])
        if n > 1:
            if not args.skip_conformance:
                _phase(report, f"conformance, {n} ranks", lambda: _conformance(worlds, n, GROUP_SHAPES))
            _phase(report, f"stream semantics, {n} ranks", lambda: worlds.get(n).run(gpu_checks.check_stream_semantics))
            _phase(report, f"CUDA graph capture, {n} ranks", lambda: worlds.get(n).run(gpu_checks.check_cuda_graph))
            _phase(report, f"sub-groups, {n} ranks", lambda: worlds.get(n).run(gpu_checks.check_split_origin))
            _phase(report, "timeout aborts the communicator, 2 ranks", lambda: worlds.get(2).run(gpu_checks.check_timeout_aborts, timeout=120))
        worlds.close()  # the sweep gets fresh processes (and torch's process group)
        sizes = [4 << (2 * k) for k in range(16) if 4 << (2 * k) <= args.max_bytes]  # 4 B, 16 B, ..., 1 GiB
        rows = _phase(report, f"all_reduce sweep, {n} ranks", lambda: worlds.get(n).run(gpu_checks.bench_all_reduce, sizes, timeout=420)[0])
    finally:
        worlds.close()
    report["seconds"] = round(time.perf_counter() - started, 1)

    staging = "kernel host-staging paths (known to fail until the kernel stages on the device)"
    failed = [name for name, entry in report["phases"].items() if not entry["ok"] and name != staging]
    md = [f"# spmd-nccl GPU checks ({report['seconds']} s)", "", "```", json.dumps(report["env"], indent=1), "```", ""]
    for name, entry in report["phases"].items():
        md.append(f"- {'ok' if entry['ok'] else 'FAILED'} ({entry['seconds']} s) {name}" + (f": {entry['error'][:500]}" if not entry["ok"] else ""))
    if rows:
        md += ["", f"## all_reduce, float32 SUM in place, {n} rank(s), back-to-back calls, slowest rank, median of 3", "", _sweep_table(rows)]
        print("\n" + _sweep_table(rows), flush=True)
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print(f"\n{len(failed)} failed phase(s){': ' + ', '.join(failed) if failed else ''}; report in {args.out}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
