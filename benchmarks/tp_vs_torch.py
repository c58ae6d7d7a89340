"""spmd's parallelize_module against torch's: a tensor-parallel MLP and a sequence-parallel block, alternated.

    python benchmarks/tp_vs_torch.py                   # 2 ranks over Gloo
    python benchmarks/tp_vs_torch.py --dim 1024 --rounds 40

The same plan (names and styles are the same in both frameworks) is applied
to two copies of one model: an MLP (ColwiseParallel then RowwiseParallel,
plain tensors in and out) and a pre-norm MLP block with a sequence-parallel
LayerNorm and a residual (one all-gather and one reduce-scatter per
direction). A step is forward, backward and an SGD update. Rounds alternate
the two sides (order rotating); the report gives each side's median step
time, the ratio of medians spmd/torch and the median of per-round ratios
(below 1.0: spmd faster). Both sides' losses are checked equal first.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn

from spmd.bench.launch import run_as_ranks
from spmd.bench.sides import alternate, finish_both, init_both, summary


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: Any) -> Any:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = MLP(dim, hidden)

    def forward(self, x: Any) -> Any:
        return x + self.mlp(self.norm(x))


def plans(tp: Any) -> dict[str, dict[str, Any]]:
    """The plan for each model, in one framework's style classes (``tp``: its tensor-parallel module)."""
    from_shard = {"input_layouts": tp.Shard(1), "desired_input_layouts": tp.Shard(1), "use_local_output": False}
    return {
        "mlp": {"fc1": tp.ColwiseParallel(), "fc2": tp.RowwiseParallel()},
        "block": {
            "": tp.PrepareModuleInput(**{k: (v,) if k != "use_local_output" else v for k, v in from_shard.items()}),
            "norm": tp.SequenceParallel(),
            "mlp": tp.PrepareModuleInput(input_layouts=(tp.Shard(1),), desired_input_layouts=(tp.Replicate(),)),
            "mlp.fc1": tp.ColwiseParallel(use_local_output=False),
            "mlp.fc2": tp.RowwiseParallel(output_layouts=tp.Shard(1), use_local_output=False),
        },
    }


class _SpmdTP:
    def __init__(self) -> None:
        import spmd
        import spmd.parallel as parallel

        self.Shard, self.Replicate = spmd.Shard, spmd.Replicate
        self.ColwiseParallel, self.RowwiseParallel = parallel.ColwiseParallel, parallel.RowwiseParallel
        self.SequenceParallel, self.PrepareModuleInput = parallel.SequenceParallel, parallel.PrepareModuleInput
        self.parallelize_module = parallel.parallelize_module


class _TorchTP:
    def __init__(self) -> None:
        import torch.distributed.tensor as ttensor
        import torch.distributed.tensor.parallel as tparallel

        self.Shard, self.Replicate = ttensor.Shard, ttensor.Replicate
        self.ColwiseParallel, self.RowwiseParallel = tparallel.ColwiseParallel, tparallel.RowwiseParallel
        self.SequenceParallel, self.PrepareModuleInput = tparallel.SequenceParallel, tparallel.PrepareModuleInput
        self.parallelize_module = tparallel.parallelize_module


def apply_plan(tp: Any, model: nn.Module, mesh: Any, plan: dict[str, Any]) -> nn.Module:
    root = plan.get("")
    rest = {k: v for k, v in plan.items() if k}
    tp.parallelize_module(model, mesh, rest)
    if root is not None:
        tp.parallelize_module(model, mesh, root)
    return model


def make_step(model: nn.Module, x: torch.Tensor) -> Callable[[], float]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        out = model(x)
        if hasattr(out, "full_tensor"):
            out = out.full_tensor()
        loss = out.pow(2).mean()
        loss.backward()
        opt.step()
        return float(loss.detach())

    return step


def worker(args: argparse.Namespace) -> None:
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh

    import spmd

    torch.set_num_threads(1)
    rank, world = init_both("gloo", "gloo")
    frameworks = {"spmd": (_SpmdTP(), spmd.init_device_mesh("cpu", (world,))), "torch": (_TorchTP(), torch_mesh("cpu", (world,)))}
    rows = []
    for label in ("mlp", "block"):
        torch.manual_seed(0)
        base = MLP(args.dim, 4 * args.dim) if label == "mlp" else Block(args.dim, 4 * args.dim)
        x = torch.randn(args.batch, args.seq, args.dim)
        steps = {}
        for name, (tp, mesh) in frameworks.items():
            model = apply_plan(tp, copy.deepcopy(base), mesh, plans(tp)[label])
            local_x = x if label == "mlp" else x.chunk(world, dim=1)[rank]
            steps[name] = make_step(model, local_x)
        losses = {name: step() for name, step in steps.items()}
        assert abs(losses["spmd"] - losses["torch"]) <= 1e-4 * max(1.0, abs(losses["torch"])), (label, losses)
        for _ in range(args.warmup):
            for step in steps.values():
                step()
        med, _, paired = summary(alternate(steps, args.rounds, tdist.barrier))
        rows.append((label, med, paired))
    if rank == 0:
        print(f"{world} ranks, Gloo, batch {args.batch} x seq {args.seq} x dim {args.dim}, {args.rounds} rounds; step = fwd + bwd + SGD")
        print(f"{'model':6s} {'spmd ms':>8s} {'torch ms':>9s} {'ratio':>6s} {'paired':>7s}")
        for label, med, paired in rows:
            print(f"{label:6s} {med['spmd'] * 1e3:8.2f} {med['torch'] * 1e3:9.2f} {med['spmd'] / med['torch']:6.3f} {paired:7.3f}")
    finish_both()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    run_as_ranks(worker, args, args.world_size)


if __name__ == "__main__":
    main()
