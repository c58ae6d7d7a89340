"""What spmd's dispatch costs per call, against torch.distributed's, with no communication at all.

    python benchmarks/dispatch_cost.py [--calls 2000] [--rounds 15]

One process. spmd runs over a no-op backend (every op returns
``Work.completed()``); torch.distributed runs over its ``fake`` process group
(every op returns a finished FakeWork). Both sides are world size 1 with the
same 4-float tensors, so all that is measured is the Python and C++ between
the call and the backend: argument checks, routing, the flight recorder, the
Work. Blocks of ``--calls`` calls of one side alternate with blocks of the
other (``--rounds`` of each), CPU time (``time.process_time``, so a busy
neighbour on the host does not count) per call is the median over the
blocks, for all_reduce, broadcast and all_gather_into_tensor, synchronous
and ``async_op=True`` + ``wait()``. The goal (issue 13) is spmd / torch <= 0.5.

The watchdog is off (``SPMD_WATCHDOG=0``): it is a thread, not per-call cost.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import types
from collections.abc import Callable

import torch
import torch.distributed as tdist

import spmd
from spmd.comm.backend import Backend, BackendSpec
from spmd.comm.reduce_op import ReduceOp
from spmd.comm.work import Work
from spmd.plugins import manager


class NoopBackend(Backend):
    """A backend whose every op has already finished: the kernel's cost alone."""

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work:
        return Work.completed()

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Work:
        return Work.completed()

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> Work:
        return Work.completed()

    def broadcast(self, tensor: torch.Tensor, src: int) -> Work:
        return Work.completed()

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        return Work.completed()


def _register_noop() -> None:
    plugin = types.ModuleType("spmd_bench_noop")

    @spmd.hookimpl
    def spmd_backends() -> list[BackendSpec]:
        return [BackendSpec("noop", ("cpu",), factory=lambda ctx: NoopBackend(ctx), description="does nothing")]

    plugin.spmd_backends = spmd_backends  # type: ignore[attr-defined]
    manager().register(plugin, name="bench-noop")


def _cases() -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    t = torch.ones(4)
    out = torch.empty(4)
    # torch 2.13 deprecates all_gather_into_tensor (with a warning per call) for all_gather_single
    torch_all_gather = getattr(tdist, "all_gather_single", tdist.all_gather_into_tensor)

    def spmd_async(fn: Callable[..., object], *args: object) -> Callable[[], object]:
        return lambda: fn(*args, async_op=True).wait()  # type: ignore[attr-defined]

    return {
        "all_reduce": (lambda: spmd.all_reduce(t), lambda: tdist.all_reduce(t)),
        "all_reduce async": (spmd_async(spmd.all_reduce, t), spmd_async(tdist.all_reduce, t)),
        "broadcast": (lambda: spmd.broadcast(t, 0), lambda: tdist.broadcast(t, 0)),
        "broadcast async": (spmd_async(spmd.broadcast, t, 0), spmd_async(tdist.broadcast, t, 0)),
        "all_gather_into_tensor": (
            lambda: spmd.all_gather_into_tensor(out, t),
            lambda: torch_all_gather(out, t),
        ),
        "all_gather_into_tensor async": (
            spmd_async(spmd.all_gather_into_tensor, out, t),
            spmd_async(torch_all_gather, out, t),
        ),
    }


def _per_call(fn: Callable[[], object], calls: int) -> float:
    start = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - start) / calls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls per block")
    parser.add_argument("--rounds", type=int, default=15, help="blocks of each side")
    args = parser.parse_args(argv)

    os.environ["SPMD_WATCHDOG"] = "0"
    from torch.testing._internal.distributed.fake_pg import (
        FakeStore,  # registers the "fake" backend
    )

    _register_noop()
    spmd.init("noop", rank=0, world_size=1, store=tdist.HashStore(), torch_interop=False)  # torch gets its own fake group
    tdist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        print(f"CPU time per call, median of {args.rounds} alternating blocks of {args.calls} calls "
              f"(torch {torch.__version__}, python {sys.version.split()[0]})")
        print(f"{'op':32} {'spmd us':>9} {'torch us':>9} {'ratio':>7}")
        ratios = []
        for name, (ours, theirs) in _cases().items():
            for fn in (ours, theirs):  # warm up both
                _per_call(fn, max(args.calls // 10, 10))
            mine, torch_side = [], []
            for _ in range(args.rounds):
                mine.append(_per_call(ours, args.calls))
                torch_side.append(_per_call(theirs, args.calls))
            a, b = statistics.median(mine), statistics.median(torch_side)
            ratios.append(a / b)
            print(f"{name:32} {a * 1e6:9.2f} {b * 1e6:9.2f} {a / b:7.2f}")
        worst = max(ratios)
        print(f"worst ratio spmd/torch: {worst:.2f} (goal <= 0.5: {'met' if worst <= 0.5 else 'NOT met'})")
    finally:
        tdist.destroy_process_group()
        spmd.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
