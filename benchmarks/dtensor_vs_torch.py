"""spmd's DTensor against torch's own DTensor: one tensor-parallel MLP step each, alternated in one run.

    python benchmarks/dtensor_vs_torch.py                   # 2 ranks over Gloo
    python benchmarks/dtensor_vs_torch.py --rounds 50 --hidden 4096 --profile

Each side holds the same 2-layer MLP as DTensors: fc1 column-sharded (weight
and bias Shard(0)), fc2 row-sharded (weight Shard(1), bias replicated), input
replicated. A step is forward, an all-reduce of the partial output (the
redistribute to Replicate), a mean-square loss and backward. Rounds alternate
the two sides (order rotating) so machine noise hits both alike; the report
gives each side's median step time, the ratio of medians spmd/torch and the
median of per-round ratios (below 1.0: spmd faster). ``--small`` adds a
dispatch-bound size (tiny matrices: the time is rule lookup and wrapping).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
from collections.abc import Callable

import torch
import torch.distributed as tdist
import torch.nn.functional as F

from spmd.bench.launch import run_as_ranks
from spmd.bench.sides import alternate, finish_both, init_both, summary


def make_side(dtensor_mod: object, mesh: object, weights: list[torch.Tensor], x: torch.Tensor) -> Callable[[], float]:
    """One side's step function over its own DTensor implementation (spmd.tensor or torch.distributed.tensor)."""
    Shard, Replicate, distribute = dtensor_mod.Shard, dtensor_mod.Replicate, dtensor_mod.distribute_tensor  # type: ignore[attr-defined]
    w1, b1, w2, b2 = weights
    params = [
        distribute(w1, mesh, [Shard(0)]).requires_grad_(),
        distribute(b1, mesh, [Shard(0)]).requires_grad_(),
        distribute(w2, mesh, [Shard(1)]).requires_grad_(),
        distribute(b2, mesh, [Replicate()]).requires_grad_(),
    ]
    xd = distribute(x, mesh, [Replicate()])

    def step() -> float:
        for p in params:
            p.grad = None
        h = F.gelu(F.linear(xd, params[0], params[1]))
        out = F.linear(h, params[2], params[3])
        loss = (out.redistribute(mesh, [Replicate()]) ** 2).mean()
        loss.backward()
        return float(loss.detach().to_local())

    return step


def worker(args: argparse.Namespace) -> None:
    import torch.distributed.tensor as ttensor
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh

    import spmd
    import spmd.tensor as stensor

    torch.set_num_threads(1)
    rank, world = init_both("gloo", "gloo")
    results = {}
    sizes = [("mlp", args.batch, args.dim, args.hidden)]
    if args.small:
        sizes.append(("small", 8, 32, 64))
    for label, batch, dim, hidden in sizes:
        torch.manual_seed(0)
        weights = [torch.randn(hidden, dim) / dim**0.5, torch.randn(hidden), torch.randn(dim, hidden) / hidden**0.5, torch.randn(dim)]
        x = torch.randn(batch, dim)
        sides = {
            "spmd": make_side(stensor, spmd.init_device_mesh("cpu", (world,)), weights, x),
            "torch": make_side(ttensor, torch_mesh("cpu", (world,)), weights, x),
        }
        losses = {name: step() for name, step in sides.items()}
        assert abs(losses["spmd"] - losses["torch"]) <= 1e-4 * max(1.0, abs(losses["torch"])), losses
        for _ in range(args.warmup):
            for step in sides.values():
                step()
        med, _, paired = summary(alternate(sides, args.rounds, tdist.barrier))
        results[label] = (batch, dim, hidden, med, paired)
        if args.profile and rank == 0:
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(20):
                sides["spmd"]()
            profiler.disable()
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(18)
            print(out.getvalue())
        elif args.profile:
            for _ in range(20):
                sides["spmd"]()
    if rank == 0:
        print(f"{world} ranks, Gloo, {args.rounds} rounds; step = forward + all-reduce + loss + backward")
        print(f"{'size':6s} {'batch':>5s} {'dim':>5s} {'hidden':>6s} {'spmd ms':>8s} {'torch ms':>9s} {'ratio':>6s} {'paired':>7s}")
        for label, (batch, dim, hidden, med, paired) in results.items():
            print(f"{label:6s} {batch:5d} {dim:5d} {hidden:6d} {med['spmd'] * 1e3:8.2f} {med['torch'] * 1e3:9.2f} "
                  f"{med['spmd'] / med['torch']:6.3f} {paired:7.3f}")
    finish_both()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="also a dispatch-bound size")
    parser.add_argument("--profile", action="store_true", help="cProfile 20 extra spmd steps on rank 0")
    args = parser.parse_args()
    run_as_ranks(worker, args, args.world_size)


if __name__ == "__main__":
    main()
