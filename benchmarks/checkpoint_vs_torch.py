"""spmd.checkpoint against torch.distributed.checkpoint (DCP): the same sharded state, alternated in one run.

    python benchmarks/checkpoint_vs_torch.py                    # 2 ranks, ~200 MB, 5 rounds
    python benchmarks/checkpoint_vs_torch.py --mb 400 --rounds 9 --dir /mnt/fast/bench

Both sides hold the same ~``--mb`` MB: ``--tensors`` fp32 matrices sharded
Shard(0) over the ranks (spmd DTensors on spmd's Gloo group, torch DTensors
on torch's own Gloo group) plus a small replicated tensor and a step counter.
Each round times, on each side, a save, a load into zeroed tensors, and an
async save (the time until it returns: what training waits; and until its
future is done), the side order alternating from round to round. Every timing
runs from a barrier to a barrier, so it is the slowest rank's. The table shows
the medians and the median of the per-round ratios spmd/torch (paired, so
drift in machine load cancels): below 1.0, spmd is faster. Files go under
``--dir`` (default: a temporary directory), one checkpoint id per side,
overwritten every round. spmd removes the data a save supersedes in a
background thread (in training, while the next steps run); here that removal
finishes untimed after each timed call, so it never slows the next one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as tdist

from spmd.bench.launch import run_as_ranks


def timed(fn: Callable[[], Any], barrier: Callable[[], None]) -> float:
    """``fn``'s time from a barrier to a barrier; then, untimed, spmd's background removal of superseded data
    finishes, so that it never runs into the next timed call (of either side)."""
    from spmd.checkpoint import cleanup

    barrier()
    start = time.perf_counter()
    fn()
    barrier()
    elapsed = time.perf_counter() - start
    cleanup.wait()
    return elapsed


def build(args: argparse.Namespace, world: int) -> tuple[dict[str, torch.Tensor], int]:
    """The global tensors: ``--tensors`` fp32 matrices of ``--mb`` MB in all, the same on every rank."""
    rows = 1024
    cols = max(1, int(args.mb * 2**20 / 4 / args.tensors / rows))
    g = torch.Generator().manual_seed(0)
    full = {f"layer{i}.weight": torch.randn(rows, cols, generator=g) for i in range(args.tensors)}
    full["bias"] = torch.randn(cols, generator=g)
    return full, sum(t.numel() * 4 for t in full.values())


def worker(args: argparse.Namespace) -> None:
    import torch.distributed.checkpoint as tdcp
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh
    from torch.distributed.tensor import Replicate as TReplicate
    from torch.distributed.tensor import Shard as TShard
    from torch.distributed.tensor import distribute_tensor as torch_distribute

    import spmd
    import spmd.checkpoint as dcp
    from spmd.checkpoint import cleanup

    warnings.filterwarnings("ignore", message="Detected an existing checkpoint")  # DCP overwrites each round
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    store = tdist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0, timedelta(seconds=60))
    spmd.init("gloo", store=store, rank=rank, world_size=world, timeout=600, torch_interop=False)
    tdist.init_process_group("gloo", store=tdist.PrefixStore("torch/", store), rank=rank, world_size=world,
                             timeout=timedelta(seconds=600))
    barrier = lambda: tdist.barrier()  # noqa: E731 - one barrier for both sides

    full, nbytes = build(args, world)
    smesh = spmd.init_device_mesh("cpu", (world,))
    tmesh = torch_mesh("cpu", (world,))

    def spmd_state(zero: bool) -> dict[str, Any]:
        model = {k: spmd.distribute_tensor(torch.zeros_like(v) if zero else v, smesh,
                                           [spmd.Shard(0)] if v.ndim == 2 else [spmd.Replicate()], src_data_rank=None)
                 for k, v in full.items()}
        return {"model": model, "step": 0 if zero else 100}

    def torch_state(zero: bool) -> dict[str, Any]:
        model = {k: torch_distribute(torch.zeros_like(v) if zero else v, tmesh,
                                     [TShard(0)] if v.ndim == 2 else [TReplicate()], src_data_rank=None)
                 for k, v in full.items()}
        return {"model": model, "step": 0 if zero else 100}

    root = args.dir or (tempfile.mkdtemp(prefix="spmd-ckpt-bench-") if rank == 0 else "")
    shared: list[Any] = [root]
    tdist.broadcast_object_list(shared, src=0)
    root = shared[0]
    paths = {"spmd": os.path.join(root, "spmd"), "torch": os.path.join(root, "torch")}
    states = {"spmd": spmd_state(False), "torch": torch_state(False)}
    targets = {"spmd": spmd_state(True), "torch": torch_state(True)}

    def save(side: str) -> None:
        (dcp.save if side == "spmd" else tdcp.save)(states[side], checkpoint_id=paths[side])

    def load(side: str) -> None:
        (dcp.load if side == "spmd" else tdcp.load)(targets[side], checkpoint_id=paths[side])

    futures: dict[str, Any] = {}

    def async_start(side: str) -> None:
        fn = dcp.async_save if side == "spmd" else tdcp.async_save
        futures[side] = fn(states[side], checkpoint_id=paths[side] + "-async")

    ops = {"save": save, "load": load}
    rows: dict[str, dict[str, list[float]]] = {s: {"save": [], "load": [], "async_block": [], "async_total": []} for s in paths}
    for r in range(args.warmup + args.rounds):
        order = ["spmd", "torch"] if r % 2 == 0 else ["torch", "spmd"]
        sample: dict[str, dict[str, float]] = {s: {} for s in order}
        for op in ("save", "load"):
            for side in order:
                sample[side][op] = timed(lambda side=side, op=op: ops[op](side), barrier)
        for side in order:
            barrier()
            start = time.perf_counter()
            async_start(side)
            sample[side]["async_block"] = time.perf_counter() - start
            futures[side].result()
            barrier()
            sample[side]["async_total"] = time.perf_counter() - start
            cleanup.wait()
        if r >= args.warmup:
            for side in order:
                for op, t in sample[side].items():
                    rows[side][op].append(t)
    ok = all(torch.equal(targets["spmd"]["model"][k].full_tensor(), full[k]) for k in full)
    ok = ok and all(torch.equal(targets["torch"]["model"][k].full_tensor(), full[k]) for k in full)
    if rank == 0:
        report(args, rows, nbytes, world, ok)
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    barrier()
    tdist.destroy_process_group()
    spmd.destroy_process_group()


def report(args: argparse.Namespace, rows: dict[str, dict[str, list[float]]], nbytes: int, world: int, ok: bool) -> None:
    med = {s: {op: statistics.median(v) for op, v in ops.items()} for s, ops in rows.items()}
    paired = {op: statistics.median(a / b for a, b in zip(rows["spmd"][op], rows["torch"][op])) for op in rows["spmd"]}
    result = {"mb": nbytes / 2**20, "world": world, "rounds": args.rounds, "median_s": med, "paired_ratio_spmd_torch": paired,
              "loaded_values_equal": ok}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"{nbytes / 2**20:.0f} MB over {world} ranks (Shard(0) + one replicated tensor), {args.rounds} rounds; "
          f"loaded values equal the saved: {ok}")
    print(f"{'':14s} {'spmd s':>8s} {'torch s':>8s} {'spmd/torch':>11s}")
    for op in ("save", "load", "async_block", "async_total"):
        print(f"{op:14s} {med['spmd'][op]:8.3f} {med['torch'][op]:8.3f} {paired[op]:11.3f}")
    print("ratios: median of per-round spmd/torch; below 1.0 spmd is faster. async_block: until async_save returns")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--mb", type=float, default=200.0, help="total size of the state in MB")
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    run_as_ranks(worker, args, args.world_size)


if __name__ == "__main__":
    main()
