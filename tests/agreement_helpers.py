"""Rank functions for test_strategy_agreement.py: strategies set up differently on one rank."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import spmd
from spmd.parallel import ColwiseParallel, RowwiseParallel, fully_shard, parallelize_module
from spmd.pipeline import PipelineStage, get_schedule


def _error(fn: Any) -> str:
    start = time.monotonic()
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - the error is the result
        return f"{type(error).__name__}: {error} [{time.monotonic() - start:.1f} s]"
    return "no error"


class Pair(nn.Module):
    """Two linear layers, registered in the order given (same names, same sizes either way)."""

    def __init__(self, order: tuple[str, ...] = ("a", "b"), sizes: dict[str, tuple[int, int]] | None = None) -> None:
        super().__init__()
        sizes = sizes or {}
        for name in order:
            self.add_module(name, nn.Linear(*sizes.get(name, (4, 4))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def disagreeing_set_ups() -> dict[str, str]:
    """Each strategy, with rank 1 set up differently from rank 0."""
    one = spmd.get_rank() == 1
    mesh = spmd.init_device_mesh("cpu", (spmd.get_world_size(),))
    g = spmd.new_group(list(range(spmd.get_world_size())))
    stage = PipelineStage(nn.Linear(2, 2), g.rank, g.size, "cpu", group=g)
    return {
        "fsdp_order": _error(lambda: fully_shard(Pair(("b", "a") if one else ("a", "b")), mesh=mesh)),
        "fsdp_shape": _error(lambda: fully_shard(Pair(sizes={"b": (4, 5)} if one else None), mesh=mesh)),
        "fsdp_extra": _error(lambda: fully_shard(Pair(("a", "b", "c") if one else ("a", "b")), mesh=mesh)),
        "fsdp_same": _error(lambda: fully_shard(Pair(), mesh=mesh)),
        "tp_plan": _error(lambda: parallelize_module(Pair(), mesh, {"a": RowwiseParallel() if one else ColwiseParallel()})),
        "tp_same": _error(lambda: parallelize_module(Pair(), mesh, {"a": ColwiseParallel(), "b": RowwiseParallel()})),
        "pipeline": _error(lambda: get_schedule("1f1b")(stage, 4 if one else 2, loss_fn=F.mse_loss)),
        "pipeline_schedule": _error(lambda: get_schedule("gpipe" if one else "1f1b")(stage, 2, loss_fn=F.mse_loss)),
    }


class Flaky(nn.Module):
    """A stage whose forward raises on the rank named, at the microbatch named."""

    def __init__(self, fail_on_rank: int, microbatch: int) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.fail = spmd.get_rank() == fail_on_rank
        self.microbatch, self.calls = microbatch, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.fail and self.calls > self.microbatch:
            raise ValueError("bad batch in the stage's forward")
        return self.lin(x)


def a_stage_raises(fail_on_rank: int) -> str:
    """A 1F1B step in which one rank's stage raises: every other rank must raise soon, naming it."""
    g = spmd.new_group(list(range(spmd.get_world_size())))
    torch.manual_seed(0)
    stage = PipelineStage(Flaky(fail_on_rank, 1), g.rank, g.size, "cpu", group=g, input_args=torch.zeros(2, 4))
    schedule = get_schedule("1f1b")(stage, 4, loss_fn=F.mse_loss)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    args = (x,) if g.rank == 0 else ()
    kwargs = {"target": y} if g.rank == g.size - 1 else {}
    return _error(lambda: schedule.step(*args, **kwargs))
