"""torch's operator database through spmd's DTensor and torch's own, side by side: how many cases each gets right.

    python benchmarks/dtensor_opdb.py                       # every op in op_db, 2 ranks over Gloo (about 30 min
                                                            # here: spmd's side ~2.5 min, torch's ~25 min)
    python benchmarks/dtensor_opdb.py --ops fast            # the fast subset the default test run sweeps
    python benchmarks/dtensor_opdb.py --ops mul,conj --max-samples 4 --show 20

Each op's samples (``spmd.testing.opdb``) run with every tensor Replicate,
and again with the first one Shard(0), in float32 and complex64; the result
and gradient are compared with plain torch. A case ends as a match, an error
(a refusal) or a mismatch (a wrong result without an error: the count that
must be 0). torch's DTensor runs in the same world over spmd's ProcessGroup.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

import spmd
from spmd.bench.launch import run_as_ranks
from spmd.testing import opdb


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    spmd.init("gloo")
    names = None if args.ops == "all" else list(opdb.FAST_OPS) if args.ops == "fast" else args.ops.split(",")
    ops = opdb.op_infos(names)
    world = spmd.get_world_size()
    reports: dict[str, Any] = {}
    impls = {"spmd": opdb.spmd_impl, "torch": opdb.torch_impl}
    for impl in (impls[name]() for name in args.impls.split(",")):
        start = time.perf_counter()
        reports[impl.name] = (opdb.sweep(impl, ops, world, max_samples=args.max_samples, case_seconds=args.case_seconds), time.perf_counter() - start)
    if spmd.get_rank() == 0:
        print(f"{len(ops)} ops of op_db, {world} ranks, float32 + complex64, Replicate and Shard(0)")
        print(f"{'':6s} {'match':>7s} {'error':>7s} {'mismatch':>9s} {'seconds':>8s}")
        for name, (report, seconds) in reports.items():
            s = report.summary()
            print(f"{name:6s} {s['match']:7d} {s['error']:7d} {s['mismatch']:9d} {seconds:8.1f}")
        if len(reports) == 2:
            ours, theirs = reports["spmd"][0].summary(), reports["torch"][0].summary()
            print(f"spmd/torch matches: {ours['match'] / max(theirs['match'], 1):.3f}")
        for name, (report, _) in reports.items():
            for case in report.mismatches()[: args.show]:
                print(f"{name} MISMATCH {case.op} {case.dtype} {case.layout} sample {case.sample}: {case.detail}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({name: [c.__dict__ for c in r.cases] for name, (r, _) in reports.items()}, f)
    spmd.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--ops", default="all", help="all, fast, or a comma-separated list of OpInfo names")
    parser.add_argument("--impls", default="spmd,torch", help="whose DTensor to sweep: spmd, torch or both (the whole sweep"
                        " of both takes over an hour; each side alone gives its own counts)")
    parser.add_argument("--max-samples", type=int, default=None, help="at most this many samples per op and dtype")
    parser.add_argument("--case-seconds", type=float, default=60.0, help="a case that runs longer ends as an error (torch's"
                        " DTensor loops forever on unflatten into a zero-sized dimension)")
    parser.add_argument("--show", type=int, default=50, help="mismatches to print per side")
    parser.add_argument("--json", default=None, help="write every case of both sides to this file")
    run_as_ranks(worker, parser.parse_args(), parser.parse_args().world_size)


if __name__ == "__main__":
    main()
