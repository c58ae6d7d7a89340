"""Raw torch ProcessGroupGloo calls for ``spmd bench --vs-raw`` (the peer spmd-gloo is measured against)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as tdist

from spmd.bench.ops import buffer, elements


def raw_gloo_ops(ctx: Any) -> dict[str, Callable[[int], Callable[[], object]]]:
    """Makers for every benchmarked op over a private ProcessGroupGloo."""
    pg = tdist.ProcessGroupGloo(ctx.store, ctx.rank, ctx.world_size, timedelta(seconds=ctx.timeout_s))
    n = ctx.world_size

    def all_reduce(nbytes: int) -> Callable[[], object]:
        t = buffer("data", elements(nbytes, 1))
        return lambda: pg.allreduce([t]).wait()

    def broadcast(nbytes: int) -> Callable[[], object]:
        t = buffer("data", elements(nbytes, 1))
        opts = tdist.BroadcastOptions()
        return lambda: pg.broadcast([t], opts).wait()

    def all_gather(nbytes: int) -> Callable[[], object]:
        total = elements(nbytes, n)
        out, inp = buffer("out", total, None), buffer("in", total // n)
        return lambda: pg._allgather_base(out, inp).wait()

    def reduce_scatter(nbytes: int) -> Callable[[], object]:
        total = elements(nbytes, n)
        out, inp = buffer("out", total // n, None), buffer("in", total)
        return lambda: pg._reduce_scatter_base(out, inp).wait()

    def all_to_all(nbytes: int) -> Callable[[], object]:
        total = elements(nbytes, n)
        out, inp = buffer("out", total, None), buffer("in", total)
        opts = tdist.AllToAllOptions()
        return lambda: pg.alltoall_base(out, inp, [], [], opts).wait()

    def sendrecv(nbytes: int) -> Callable[[], object]:
        t = buffer("data", elements(nbytes, 1))
        if ctx.rank == 0:
            return lambda: (pg.send([t], 1, 0).wait(), pg.recv([t], 1, 0).wait())
        if ctx.rank == 1:
            return lambda: (pg.recv([t], 0, 0).wait(), pg.send([t], 0, 0).wait())
        return lambda: None

    return {
        "all_reduce": all_reduce,
        "all_gather_into_tensor": all_gather,
        "reduce_scatter_tensor": reduce_scatter,
        "broadcast": broadcast,
        "all_to_all_single": all_to_all,
        "sendrecv": sendrecv,
    }
