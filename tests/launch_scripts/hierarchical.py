"""spmd.init() with no backend on 2 nodes x 2 ranks: the world's all_reduce is hierarchical (shm inside a node, Gloo between).

    python hierarchical.py check TIMEOUT        # sizes x dtypes x ops against the one-process result, async order
    python hierarchical.py kill TIMEOUT RANK     # RANK SIGKILLs itself inside an all_reduce; the others time their error
    python hierarchical.py stall TIMEOUT RANK    # RANK arrives TIMEOUT + 3 s late; the others time their error

Rank, world and the store come from MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE. Prints one REPORT line (JSON).
"""

import json
import os
import signal
import sys
import time

import torch

import spmd
from spmd.comm.state import get_state

OPS = {"sum": spmd.ReduceOp.SUM, "avg": spmd.ReduceOp.AVG, "product": spmd.ReduceOp.PRODUCT,
       "min": spmd.ReduceOp.MIN, "max": spmd.ReduceOp.MAX}


def inputs(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s input: small whole numbers 1..5, so every reduction of 4 ranks is exact in every dtype used."""
    return ((torch.arange(n) * (rank + 3) + rank) % 5 + 1).to(dtype)


def one_process(world: int, n: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    """What the all_reduce must give, computed here from every rank's input."""
    stacked = torch.stack([inputs(r, n, dtype) for r in range(world)])
    if op == "avg":
        return stacked.sum(0) / world
    return {"sum": stacked.sum(0), "product": stacked.prod(0), "min": stacked.amin(0), "max": stacked.amax(0)}[op].to(dtype)


def check(rank: int, world: int) -> dict:
    failures = []
    cases = 0
    for dtype in (torch.float32, torch.float64, torch.int32, torch.int64, torch.bfloat16):
        for n in (1, 1000, 300_000):
            for op in OPS:
                if op == "avg" and not dtype.is_floating_point or dtype == torch.bfloat16 and op in ("product", "avg"):
                    continue
                t = inputs(rank, n, dtype)
                spmd.all_reduce(t, op=OPS[op])
                cases += 1
                if not torch.equal(t, one_process(world, n, dtype, op)):
                    failures.append(f"{op} {dtype} n={n}")
    # async ops, the hierarchical ones queued behind each other and other ops between: each result right
    big = [inputs(rank, 100_000 + i, torch.float32) for i in range(6)]
    works = [spmd.all_reduce(t, async_op=True) for t in big]
    b = torch.full((4,), float(rank))
    works.append(spmd.broadcast(b, src=1, async_op=True))
    gathered = torch.empty(world, dtype=torch.int64)
    works.append(spmd.all_gather_into_tensor(gathered, torch.tensor([rank * 10]), async_op=True))
    last = inputs(rank, 7, torch.float64)
    works.append(spmd.all_reduce(last, op=spmd.ReduceOp.MAX, async_op=True))
    for w in works:
        w.wait()
    for i, t in enumerate(big):
        if not torch.equal(t, one_process(world, 100_000 + i, torch.float32, "sum")):
            failures.append(f"async all_reduce #{i}")
    if not torch.equal(b, torch.full((4,), 1.0)) or gathered.tolist() != [r * 10 for r in range(world)]:
        failures.append("async broadcast / all_gather between hierarchical all_reduces")
    if not torch.equal(last, one_process(world, 7, torch.float64, "max")):
        failures.append("async all_reduce MAX after the others")
    backend = get_state().world.backend("cpu")
    return {"cases": cases + len(works), "failures": failures, "get_backend": spmd.get_backend(),
            "kind": type(backend).__name__, "describe": getattr(backend, "describe", lambda: "")()}


def fault(scenario: str, rank: int, victim: int, timeout: float) -> dict:
    t = torch.ones(1 << 18)
    for _ in range(3):
        spmd.all_reduce(t)
    if rank == victim and scenario == "kill":
        spmd.all_reduce(torch.ones(1 << 18), async_op=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == victim:  # stall: late for the op, then gone
        time.sleep(timeout + 3)
        os._exit(0)
    time.sleep(0.2)  # (the victim is gone before the others' next op)
    start = time.monotonic()
    report: dict = {}
    try:
        spmd.all_reduce(t)
        report["error"] = None
    except Exception as error:  # noqa: BLE001 - reported
        report.update(error=type(error).__name__, spmd_error=isinstance(error, spmd.SpmdError), message=str(error)[:600])
    report["elapsed"] = time.monotonic() - start
    start = time.monotonic()
    try:
        spmd.all_reduce(t)
        report["after"] = None
    except Exception as error:  # noqa: BLE001 - reported
        report["after"] = type(error).__name__
    report["after_elapsed"] = time.monotonic() - start
    return report


def main() -> None:
    scenario, timeout = sys.argv[1], float(sys.argv[2])
    torch.set_num_threads(1)
    spmd.init(timeout=timeout)
    rank, world = spmd.get_rank(), spmd.get_world_size()
    report = check(rank, world) if scenario == "check" else fault(scenario, rank, int(sys.argv[3]), timeout)
    print("REPORT " + json.dumps({"rank": rank, **report}), flush=True)
    if scenario == "check":
        spmd.destroy_process_group()
    else:
        os._exit(0)  # (the world is broken: nothing to tear down)


if __name__ == "__main__":
    main()
