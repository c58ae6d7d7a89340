"""spmd DDP against torch DDP, both over Gloo: the same model and data, steps alternated in one run.

    python benchmarks/ddp_vs_torch.py                   # 2 ranks, a 14 M-parameter MLP
    python benchmarks/ddp_vs_torch.py --rounds 10 --width 2048 --profile

Three wrappers of three identical copies of one model train side by side:
spmd DDP, torch DDP with its defaults, and torch DDP with
``gradient_as_bucket_view=True`` (what spmd always does). Each round runs one
training step (zero_grad, forward, backward, SGD step) of every side, the
order rotating from round to round so drift hits all alike (the measurements
below are part of the same rotation); the table shows the median step time of
each, the ratios spmd/torch of those medians, and the median of the per-round
ratios (paired, so slow drift in machine load cancels); below 1.0: spmd faster.

Hidden communication. Separately, with the same sizes, it measures
``compute``: forward+backward of an unwrapped copy (no communication), and
``comm``: all-reducing buffers of the gradient buckets' sizes, all in flight at
once, with nothing else running (through spmd for spmd, through torch's Gloo
group for torch; both DDPs cut buckets by the same rule).
With ``ddp`` the forward+backward time of the wrapped model::

    exposed = ddp - compute             # communication time backward did not hide
    hidden share = (compute + comm - ddp) / comm    (clamped to 0..1)

1.0 means all of the communication overlapped the backward; 0.0 means none did.
``--profile`` runs cProfile on rank 0 over extra spmd steps and prints the top entries.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import json
import os
import pstats
import statistics
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as tdist
from torch import nn

from spmd.bench.launch import run_as_ranks


def make_model(width: int, depth: int) -> nn.Module:
    """An MLP of ``depth`` square layers (``depth * width**2`` parameters)."""
    layers: list[nn.Module] = [nn.Linear(64, width), nn.GELU()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def fwd_bwd(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    for p in model.parameters():
        p.grad = None
    nn.functional.cross_entropy(model(x), y).backward()


def timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bucket_allreduce(buffers: list[torch.Tensor], reduce: Callable[[torch.Tensor], object]) -> Callable[[], None]:
    """All-reduce every buffer, all in flight at once (as DDP launches them), then wait."""

    def run() -> None:
        works = [reduce(b) for b in buffers]
        for work in works:
            work.wait()  # type: ignore[attr-defined]

    return run


def worker(args: argparse.Namespace) -> None:
    import spmd
    from spmd.parallel import DistributedDataParallel as DDP

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    store = tdist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0, timedelta(seconds=60))
    spmd.init(args.backend, store=store, rank=rank, world_size=world, timeout=300, torch_interop=False)  # torch runs on Gloo here
    tdist.init_process_group("gloo", store=tdist.PrefixStore("torch/", store), rank=rank, world_size=world,
                             timeout=timedelta(seconds=300))
    barrier = lambda: tdist.barrier()  # noqa: E731 - one barrier for every side

    torch.manual_seed(0)
    base = make_model(args.width, args.depth)
    n_params = sum(p.numel() for p in base.parameters())
    sides: dict[str, nn.Module] = {
        "spmd": DDP(copy.deepcopy(base), bucket_cap_mb=args.bucket_cap_mb),
        "torch": nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=args.bucket_cap_mb),
        "torch_view": nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=args.bucket_cap_mb,
                                                          gradient_as_bucket_view=True),
    }
    opts = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, m in sides.items()}
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(args.batch, 64, generator=g), torch.randint(0, 10, (args.batch,), generator=g)
    names = list(sides)
    for _ in range(args.warmup):  # connections, allocations, torch's bucket rebuild after step 1
        for name in names:
            train_step(sides[name], opts[name], x, y)

    # Every measurement of one round runs back to back, the order rotating from round to round,
    # so machine noise hits all of them alike: training steps, and the parts of the overlap formula.
    plain = copy.deepcopy(base)
    spmd_buffers = [b.buffer().clone() for b in sides["spmd"].reducer.buckets]  # type: ignore[union-attr]
    probes: dict[str, Callable[[], None]] = {f"step:{n}": (lambda n=n: train_step(sides[n], opts[n], x, y)) for n in names}
    probes.update({f"fwd_bwd:{n}": (lambda m=sides[n]: fwd_bwd(m, x, y)) for n in names})
    probes["compute"] = lambda: fwd_bwd(plain, x, y)
    probes["comm:spmd"] = bucket_allreduce(spmd_buffers, lambda b: spmd.all_reduce(b, async_op=True))
    probes["comm:torch"] = bucket_allreduce(spmd_buffers, lambda b: tdist.all_reduce(b, async_op=True))
    keys = list(probes)
    times: dict[str, list[float]] = {k: [] for k in keys}
    for r in range(args.rounds):
        for k in range(len(keys)):
            key = keys[(r + k) % len(keys)]
            barrier()
            times[key].append(timed(probes[key]))
    med = {k: statistics.median(t) for k, t in times.items()}
    medians = {n: med[f"step:{n}"] for n in names}
    # Paired: the ratio within each round (measured minutes apart at most) cancels slow drift.
    paired = {n: statistics.median(a / b for a, b in zip(times["step:spmd"], times[f"step:{n}"])) for n in ("torch", "torch_view")}
    compute = med["compute"]
    overlap = {}
    for name in names:
        comm = med["comm:spmd" if name == "spmd" else "comm:torch"]
        ddp = med[f"fwd_bwd:{name}"]
        hidden = min(1.0, max(0.0, (compute + comm - ddp) / comm))
        overlap[name] = {"ddp_fwd_bwd_s": ddp, "comm_s": comm, "exposed_s": ddp - compute, "hidden_share": hidden}

    if args.profile and rank == 0:
        profiler = cProfile.Profile()
        profiler.enable()
    for _ in range(args.profile_steps if args.profile else 0):
        train_step(sides["spmd"], opts["spmd"], x, y)
    if args.profile and rank == 0:
        profiler.disable()
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(14)
        print(out.getvalue())

    if rank == 0:
        result = {"params": n_params, "buckets": len(sides["spmd"].reducer.buckets),  # type: ignore[union-attr]
                  "median_step_s": medians, "ratio_spmd_torch": medians["spmd"] / medians["torch"],
                  "ratio_spmd_torch_view": medians["spmd"] / medians["torch_view"], "compute_fwd_bwd_s": compute,
                  "paired_ratio_spmd_torch": paired["torch"], "paired_ratio_spmd_torch_view": paired["torch_view"],
                  "overlap": overlap}
        if args.json:
            print(json.dumps(result, indent=1))
        else:
            report(result, args)
    spmd.destroy_process_group()
    tdist.destroy_process_group()


def report(r: dict, args: argparse.Namespace) -> None:
    ms = lambda s: f"{s * 1e3:9.1f}"  # noqa: E731
    print(f"spmd on {args.backend}, torch on gloo: {r['params'] / 1e6:.1f} M parameters, {r['buckets']} spmd buckets (bucket_cap_mb={args.bucket_cap_mb}), "
          f"batch {args.batch}, {args.rounds} rounds; median step time (zero_grad+fwd+bwd+SGD)")
    print(f"{'side':12s} {'step ms':>9s} {'fwd+bwd ms':>11s} {'comm ms':>9s} {'exposed ms':>11s} {'hidden':>7s}")
    for name, step in r["median_step_s"].items():
        o = r["overlap"][name]
        print(f"{name:12s} {ms(step)} {ms(o['ddp_fwd_bwd_s'])}  {ms(o['comm_s'])} {ms(o['exposed_s'])}  {o['hidden_share']:6.0%}")
    print(f"compute-only fwd+bwd: {ms(r['compute_fwd_bwd_s']).strip()} ms")
    print(f"ratio of medians  spmd/torch: {r['ratio_spmd_torch']:.3f}   spmd/torch_view: {r['ratio_spmd_torch_view']:.3f}")
    print(f"median of per-round ratios  spmd/torch: {r['paired_ratio_spmd_torch']:.3f}   "
          f"spmd/torch_view: {r['paired_ratio_spmd_torch_view']:.3f}")
    print("hidden share = (compute + comm - ddp fwd+bwd) / comm, clamped to 0..1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--width", type=int, default=1536)
    parser.add_argument("--depth", type=int, default=6, help="square hidden layers")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    parser.add_argument("--rounds", type=int, default=20, help="steps per side; the median is reported")
    parser.add_argument("--backend", default="gloo", help="spmd's backend (torch's DDP stays on Gloo): gloo compares the "
                        "frameworks on one transport; shm, spmd's default on one host, what a user gets by default")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="cProfile extra spmd steps on rank 0")
    parser.add_argument("--profile-steps", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    run_as_ranks(worker, args, args.world_size)


if __name__ == "__main__":
    main()
