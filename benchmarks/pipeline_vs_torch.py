"""spmd's pipeline schedules against the simulator, and spmd 1F1B against torch's Schedule1F1B (on Gloo).

    python benchmarks/pipeline_vs_torch.py                  # 4 ranks, 8 blocks of width 256, 8 microbatches
    python benchmarks/pipeline_vs_torch.py --rounds 20 --width 512 --json

One model of 8 blocks (Linear, ReLU, Linear, ReLU) is cut into 4 stages (2
blocks each; interleaved_1f1b: 8 stages of 1 block, 2 per rank). For each
schedule the run first measures every stage's forward, backward, and split
backward (B: input gradient, W: weight gradient) on one microbatch (the last
stage's with its loss, which a step computes there too), one rank
at a time so that each has a core, gives those per-stage costs to
``spmd.pipeline.simulate`` for a predicted step time (the simulator gives
each rank a core; on a host with fewer cores than ranks the prediction is
all compute / cores when that is longer), then times real steps (the
slowest rank's, median over rounds):
``measured / predicted`` near 1.0 means the runtime adds little besides
compute; above, transfers and Python overhead. Then spmd's 1F1B and torch's
``Schedule1F1B`` on identical copies of the stages alternate round by round;
``spmd/torch`` below 1.0: spmd faster.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn

from spmd.bench.launch import run_as_ranks
from spmd.bench.sides import finish_both, init_both


def make_blocks(width: int, n: int) -> list[nn.Module]:
    """``n`` blocks Linear-ReLU-Linear-ReLU, the same on every rank."""
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU()) for _ in range(n)]


def stage_costs(module: nn.Module, x: torch.Tensor, reps: int, target: torch.Tensor | None = None) -> dict[str, float]:
    """Median seconds of forward, full backward, and split backward (B, W) of ``module`` on ``x``; with
    ``target`` (the last stage) the forward includes the loss and the backward starts from it, as in a step."""
    params = [p for p in module.parameters()]

    def forward(inp: torch.Tensor) -> torch.Tensor:
        out = module(inp)
        return out if target is None else F.mse_loss(out, target)

    f, b, bi, w = [], [], [], []
    for _ in range(reps):
        inp = x.detach().requires_grad_(True)
        t0 = time.perf_counter()
        out = forward(inp)
        t1 = time.perf_counter()
        out.backward(torch.ones_like(out))
        t2 = time.perf_counter()
        out = forward(inp)
        t3 = time.perf_counter()
        torch.autograd.grad(out, [inp], torch.ones_like(out), retain_graph=True)
        t4 = time.perf_counter()
        torch.autograd.backward(out, torch.ones_like(out), inputs=params)
        t5 = time.perf_counter()
        f.append(t1 - t0)
        b.append(t2 - t1)
        bi.append(t4 - t3)
        w.append(t5 - t4)
    module.zero_grad(set_to_none=True)
    return {"F": statistics.median(f), "B": statistics.median(b), "B_split": statistics.median(bi), "W": statistics.median(w)}


def worker(args: argparse.Namespace) -> None:
    from spmd.pipeline import PipelineStage, get_schedule, simulate

    torch.set_num_threads(1)
    rank, world = init_both(args.backend, "gloo")
    from torch.distributed.pipelining import PipelineStage as TorchStage
    from torch.distributed.pipelining import Schedule1F1B

    m, batch, width = args.microbatches, args.batch, args.width
    cores = len(os.sched_getaffinity(0))
    blocks = make_blocks(width, 2 * world)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)
    mb_x, mb_y = x[: batch // m], y[: batch // m]

    def run_rounds(step: Any, zero: Any) -> list[float]:
        times = []
        for i in range(args.warmup + args.rounds):
            zero()
            tdist.barrier()
            t0 = time.perf_counter()
            step()
            t = torch.tensor([time.perf_counter() - t0])
            tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
            if i >= args.warmup:
                times.append(t.item())
        return times

    def make_step(schedule: Any, first: bool, last: bool) -> Any:
        losses: list[torch.Tensor] = []
        if first:
            return lambda: schedule.step(x)
        if last:
            return lambda: schedule.step(target=y, losses=losses)
        return lambda: schedule.step()

    rows: list[dict[str, Any]] = []
    for name in args.schedules.split(","):
        cls = get_schedule(name)
        v = cls.stages_per_rank
        n_stages = world * v
        per = 2 * world // n_stages
        pieces = [nn.Sequential(*blocks[i * per : (i + 1) * per]) for i in range(n_stages)]
        mine = list(range(rank, n_stages, world))
        local: dict[int, dict[str, float]] = {}
        for r in range(world):  # one rank at a time: each measurement has a core to itself
            tdist.barrier()
            if r == rank:
                local = {s: stage_costs(pieces[s], mb_x, args.cost_reps, mb_y if s == n_stages - 1 else None) for s in mine}
        gathered: list[Any] = [None] * world
        tdist.all_gather_object(gathered, local)
        costs = {s: c for d in gathered for s, c in d.items()}
        has_w = name == "zb_h1"

        def cost(a: Any, costs: dict = costs, has_w: bool = has_w) -> float:
            c = costs[a.stage]
            kind = a.kind.value
            if kind == "B":
                return c["B_split"] if has_w else c["B"]
            return c.get(kind, 0.0) if kind in ("F", "W") else 0.0

        programs = cls.programs(n_stages, v, m)
        simulated = simulate(programs, cost).makespan
        # The simulator gives every rank a core; with fewer cores than ranks no schedule beats all work / cores.
        work = sum(cost(a) for program in programs.values() for a in program)
        predicted = max(simulated, work / min(cores, world))
        stages = [PipelineStage(pieces[s], s, n_stages, "cpu") for s in mine]
        schedule = cls(stages if v > 1 else stages[0], m, loss_fn=F.mse_loss)
        zero = lambda pieces=pieces: [p.zero_grad(set_to_none=True) for p in pieces]  # noqa: E731
        times = run_rounds(make_step(schedule, 0 in mine, n_stages - 1 in mine), zero)
        measured = statistics.median(times)
        rows.append({"schedule": name, "stages": n_stages, "measured_ms": measured * 1e3, "simulated_ms": simulated * 1e3,
                     "predicted_ms": predicted * 1e3, "ratio": measured / predicted})

    # spmd 1F1B against torch Schedule1F1B, alternating rounds on identical stages.
    pieces = [nn.Sequential(*blocks[2 * i : 2 * i + 2]) for i in range(world)]
    ours, theirs = pieces[rank], copy.deepcopy(pieces[rank])
    first, last = rank == 0, rank == world - 1
    spmd_step = make_step(get_schedule("1f1b")(PipelineStage(ours, rank, world, "cpu"), m, loss_fn=F.mse_loss), first, last)
    torch_step = make_step(Schedule1F1B(TorchStage(theirs, rank, world, torch.device("cpu")), m, loss_fn=F.mse_loss), first, last)
    sides = {"spmd": (spmd_step, lambda: ours.zero_grad(set_to_none=True)),
             "torch": (torch_step, lambda: theirs.zero_grad(set_to_none=True))}
    per_side: dict[str, list[float]] = {"spmd": [], "torch": []}
    for i in range(args.warmup + args.rounds):
        order = ["spmd", "torch"] if i % 2 == 0 else ["torch", "spmd"]
        for side in order:
            step, zero = sides[side]
            zero()
            tdist.barrier()
            t0 = time.perf_counter()
            step()
            el = torch.tensor([time.perf_counter() - t0])
            tdist.all_reduce(el, op=tdist.ReduceOp.MAX)
            if i >= args.warmup:
                per_side[side].append(el.item())
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)  # same gradients, or the timing means nothing
    s_med, t_med = statistics.median(per_side["spmd"]), statistics.median(per_side["torch"])
    paired = statistics.median(a / b for a, b in zip(per_side["spmd"], per_side["torch"], strict=True))
    vs = {"spmd_ms": s_med * 1e3, "torch_ms": t_med * 1e3, "ratio_of_medians": s_med / t_med, "median_paired_ratio": paired}
    if rank == 0:
        import spmd

        if args.json:
            print(json.dumps({"schedules": rows, "1f1b_vs_torch": vs}))
        else:
            print(f"{world} ranks on {cores} cores, spmd on {spmd.get_backend()} (torch on Gloo), width {width}, batch {batch}, {m} microbatches, "
                  f"median of {args.rounds} rounds")
            print(f"{'schedule':<18}{'stages':>7}{'measured ms':>13}{'simulated ms':>14}{'predicted ms':>14}{'measured/pred':>15}")
            for r in rows:
                print(f"{r['schedule']:<18}{r['stages']:>7}{r['measured_ms']:>13.2f}{r['simulated_ms']:>14.2f}"
                      f"{r['predicted_ms']:>14.2f}{r['ratio']:>15.2f}")
            print("predicted: the simulated makespan, or all compute / cores when that is longer (fewer cores than ranks)")
            print(f"1F1B: spmd {vs['spmd_ms']:.2f} ms, torch Schedule1F1B {vs['torch_ms']:.2f} ms, "
                  f"spmd/torch {vs['ratio_of_medians']:.3f} (median paired ratio {vs['median_paired_ratio']:.3f})")
    finish_both()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--schedules", default="gpipe,1f1b,interleaved_1f1b,zb_h1")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--cost-reps", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--backend", default=None, help="spmd's backend (default: spmd.init()'s own choice, spmd-shm on one "
                        "host); torch's side stays on Gloo")
    args = parser.parse_args()
    run_as_ranks(worker, args, args.world_size)


if __name__ == "__main__":
    main()
