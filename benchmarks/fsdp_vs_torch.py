"""spmd fully_shard against torch's fully_shard (FSDP2), both over Gloo: one model, one batch, steps alternated.

    python benchmarks/fsdp_vs_torch.py                      # 2 ranks, an MLP of 10 blocks (10.6 M parameters)
    python benchmarks/fsdp_vs_torch.py --width 1536 --depth 8 --rounds 30 --json

Two identical copies of one model are sharded the same way (``fully_shard``
on every block, then on the root) by spmd and by
``torch.distributed.fsdp.fully_shard``, on the same ranks (spmd's Gloo groups
and torch's Gloo process group side by side) and trained with AdamW on the
same batch. Each round runs one step (zero_grad, forward, backward, AdamW
step) of each side, the order alternating from round to round; the table
shows each side's median step time, the ratio spmd/torch of the medians and
the median of the per-round ratios (paired: slow drift in machine load
cancels). Below 1.0: spmd is faster.

Memory: in separate rounds (so sampling cannot slow the timed steps), a
thread samples the process's resident set size (``/proc/self/statm``) every
``--sample-ms`` during one step of one side; the figure is the peak RSS during
the step minus the RSS just before it (what the step's unsharded parameters,
gradients, activations and communication buffers add), median over rounds.
The ranks run with ``MALLOC_MMAP_THRESHOLD_=65536`` so glibc returns freed
tensors to the OS at once and RSS follows live memory; a full garbage
collection runs before each measured step. Python's tracemalloc
would not see these allocations (torch allocates with C malloc).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as tdist
from torch import nn

from spmd.bench.launch import run_as_ranks
from spmd.bench.sides import finish_both, init_both

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.gelu(self.fc(x))


class Net(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.inp = nn.Linear(64, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def peak_rss_delta(fn: Callable[[], None], interval: float) -> int:
    """Peak RSS while ``fn`` runs, minus the RSS before it (bytes), sampled every ``interval`` seconds.

    A full garbage collection first: memory the previous step left in reference cycles (spmd's
    Works over Gloo leave some, freed at the next collection) is not charged to this step.
    """
    gc.collect()
    base = rss()
    peak = [base]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(interval)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        fn()
    finally:
        done.set()
        thread.join()
    return max(peak[0], rss()) - base


def worker(args: argparse.Namespace) -> None:
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import spmd
    from spmd.parallel import fully_shard

    torch.set_num_threads(1)
    rank, world = init_both("gloo", "gloo")
    barrier = lambda: tdist.barrier()  # noqa: E731 - one barrier for every side

    torch.manual_seed(0)
    base = Net(args.width, args.depth)
    n_params = sum(p.numel() for p in base.parameters())
    sides: dict[str, nn.Module] = {"spmd": copy.deepcopy(base), "torch": copy.deepcopy(base)}
    spmd_mesh = spmd.init_device_mesh("cpu", (world,))
    t_mesh = torch_mesh("cpu", (world,))
    for block in sides["spmd"].blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=spmd_mesh, reshard_after_forward=args.reshard)
    fully_shard(sides["spmd"], mesh=spmd_mesh, reshard_after_forward=args.reshard)
    for block in sides["torch"].blocks:  # type: ignore[union-attr]
        torch_fully_shard(block, mesh=t_mesh, reshard_after_forward=args.reshard)
    torch_fully_shard(sides["torch"], mesh=t_mesh, reshard_after_forward=args.reshard)
    del base
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in sides.items()}
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(args.batch, 64, generator=g), torch.randint(0, 10, (args.batch,), generator=g)
    names = list(sides)
    for _ in range(args.warmup):  # connections, allocations, optimizer state, spmd's recorded unit order
        for name in names:
            train_step(sides[name], opts[name], x, y)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        for k in range(len(names)):
            name = names[(r + k) % len(names)]
            barrier()
            start = time.perf_counter()
            train_step(sides[name], opts[name], x, y)
            times[name].append(time.perf_counter() - start)
    memory: dict[str, list[int]] = {n: [] for n in names}
    for r in range(args.memory_rounds):
        for k in range(len(names)):
            name = names[(r + k) % len(names)]
            barrier()
            memory[name].append(peak_rss_delta(lambda n=name: train_step(sides[n], opts[n], x, y), args.sample_ms / 1e3))
    # The two sides must still agree: same data, same optimizer, same averaging.
    diff = max((p.full_tensor() - q.full_tensor()).abs().max().item()  # type: ignore[attr-defined]
               for p, q in zip(sides["spmd"].parameters(), sides["torch"].parameters()))
    med = {n: statistics.median(t) for n, t in times.items()}
    paired = statistics.median(a / b for a, b in zip(times["spmd"], times["torch"]))
    mem = {n: statistics.median(m) for n, m in memory.items()}
    gathered: list[object] = [None] * world
    tdist.all_gather_object(gathered, {"med": med, "mem": mem})
    if rank == 0:
        result = {"params": n_params, "world": world, "reshard_after_forward": args.reshard, "batch": args.batch,
                  "median_step_s": med, "ratio_spmd_torch": med["spmd"] / med["torch"], "paired_ratio_spmd_torch": paired,
                  "peak_rss_delta_bytes": mem, "memory_ratio_spmd_torch": mem["spmd"] / max(mem["torch"], 1),
                  "per_rank": gathered, "max_param_diff_after_training": diff}
        if args.json:
            print(json.dumps(result, indent=1))
        else:
            report(result, args)
    finish_both()


def report(r: dict, args: argparse.Namespace) -> None:
    mb = lambda b: f"{b / 2**20:9.1f}"  # noqa: E731
    print(f"{r['params'] / 1e6:.1f} M parameters, {r['world']} ranks, batch {r['batch']}, reshard_after_forward="
          f"{r['reshard_after_forward']}, {args.rounds} timed rounds, {args.memory_rounds} memory rounds")
    print(f"{'side':8s} {'step ms':>9s} {'peak RSS delta MiB':>19s}")
    for name, step in r["median_step_s"].items():
        print(f"{name:8s} {step * 1e3:9.1f} {mb(r['peak_rss_delta_bytes'][name]):>19s}")
    print(f"ratio of medians spmd/torch: {r['ratio_spmd_torch']:.3f}   median of per-round ratios: "
          f"{r['paired_ratio_spmd_torch']:.3f}   memory spmd/torch: {r['memory_ratio_spmd_torch']:.3f}")
    print(f"max |spmd - torch| parameter difference after every step: {r['max_param_diff_after_training']:.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=10, help="blocks (one fully_shard unit each)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=20, help="timed steps per side; the median is reported")
    parser.add_argument("--memory-rounds", type=int, default=5)
    parser.add_argument("--sample-ms", type=float, default=0.5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-reshard", dest="reshard", action="store_false", help="reshard_after_forward=False")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # the ranks inherit it: freed tensors leave RSS at once
    run_as_ranks(worker, args, args.world_size)


if __name__ == "__main__":
    main()
