"""spmd-mpi against raw mpi4py: same op, same sizes, alternated call by call in one run.

    python benchmarks/mpi_vs_mpi4py.py                    # re-runs itself under mpiexec -n 2; 4 B .. 64 MiB
    python benchmarks/mpi_vs_mpi4py.py --ops all_reduce --max-bytes 4194304
    mpiexec -n 4 python benchmarks/mpi_vs_mpi4py.py       # any world size, launched by you

All sides share one set of float32 buffers per size (spmd.bench.ops.buffer: where a
buffer lies moves an op's time by up to 5 % here), reused for
every call: spmd calls ``spmd.all_reduce(t)`` etc. on torch tensors (the
``mpi`` backend: non-blocking MPI calls plus a timed, polling wait); raw
calls mpi4py's blocking ``comm.Allreduce(MPI.IN_PLACE, a, MPI.SUM)`` etc. on
numpy views, on its own duplicate of ``MPI_COMM_WORLD``. For each op and size
the sides alternate call by call (rotating which goes first) so machine noise
hits all alike; the table shows the median per-call time of each, the ratio
spmd/raw (below 1.0: spmd faster) and raw2/raw, a second identical raw
communicator against the first: how far two equal things differ here (the
noise floor of the ratio). backend is the same op called on the world
group's MpiBackend directly (``backend.all_reduce(t, SUM)`` and a wait on its handle): what
spmd-mpi itself costs, without the kernel's per-call work (argument checks,
flight recorder, Work bookkeeping). Size is the bytes of the per-rank tensor for
all_reduce and broadcast, of the output for all_gather_into_tensor and of the
input for reduce_scatter_tensor and all_to_all_single.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from spmd.bench.launch import relaunch_locally
from spmd.bench.ops import buffer, elements, spmd_ops
from spmd.bench.report import human
from spmd.bench.timing import iterations_for_bytes, stepped_sweep, time_interleaved

OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "all_to_all_single")
#: Targets of the issue: spmd/raw at or below these.
TARGET_LARGE, TARGET_SMALL, LARGE_FROM = 1.05, 1.5, 256 << 10


def backend_calls(world: int):  # type: ignore[no-untyped-def]
    """The same ops on the world group's MpiBackend directly: spmd-mpi's cost without the kernel's."""

    import spmd
    from spmd.comm.state import get_state

    backend = get_state().world.backend("cpu")
    total_op = spmd.ReduceOp.SUM

    def wait(result) -> None:  # type: ignore[no-untyped-def]
        """Finish what a backend method returned: a Work, or spmd-mpi's NativeWork handle (no kernel wrapper)."""
        if isinstance(result, spmd.Work):
            result.wait()
        else:
            result.wait(None)

    def all_reduce(nbytes: int):  # type: ignore[no-untyped-def]
        t = buffer("data", elements(nbytes, 1))
        return lambda: wait(backend.all_reduce(t, total_op))

    def broadcast(nbytes: int):  # type: ignore[no-untyped-def]
        t = buffer("data", elements(nbytes, 1))
        return lambda: wait(backend.broadcast(t, 0))

    def all_gather(nbytes: int):  # type: ignore[no-untyped-def]
        total = elements(nbytes, world)
        out, inp = buffer("out", total, None), buffer("in", total // world)
        return lambda: wait(backend.all_gather_into_tensor(out, inp))

    def reduce_scatter(nbytes: int):  # type: ignore[no-untyped-def]
        total = elements(nbytes, world)
        out, inp = buffer("out", total // world, None), buffer("in", total)
        return lambda: wait(backend.reduce_scatter_tensor(out, inp, total_op))

    def all_to_all(nbytes: int):  # type: ignore[no-untyped-def]
        total = elements(nbytes, world)
        out, inp = buffer("out", total, None), buffer("in", total)
        splits = [total // world] * world
        return lambda: wait(backend.all_to_all_single(out, inp, splits, splits))

    return {
        "all_reduce": all_reduce,
        "all_gather_into_tensor": all_gather,
        "reduce_scatter_tensor": reduce_scatter,
        "broadcast": broadcast,
        "all_to_all_single": all_to_all,
    }


def worker(args: argparse.Namespace) -> None:
    import torch

    import spmd
    from spmd_mpi.bench_peer import raw_mpi_ops

    torch.set_num_threads(1)
    spmd.init("mpi", timeout=300)  # rank and world from mpiexec
    rank, world = spmd.get_rank(), spmd.get_world_size()
    ours_all, raw_all, control_all = spmd_ops(world, rank), raw_mpi_ops(), raw_mpi_ops()
    spmd.barrier()  # creates the world's backend, which backend_calls uses
    direct_all = backend_calls(world)
    from mpi4py import MPI

    barrier = MPI.COMM_WORLD.Barrier
    if rank == 0 and not args.json:
        library = MPI.Get_library_version().strip().splitlines()[0].strip()
        print(f"{world} ranks, {library}; median per call, spmd and raw mpi4py alternating call by call; "
              "ratio = spmd / raw; raw2/raw = control")
        print(f"{'op':24s} {'size':>8s} {'spmd us':>10s} {'raw us':>10s} {'ratio':>7s} {'raw2/raw':>8s} "
              f"{'backend us':>10s} {'backend/raw':>11s}", flush=True)
    results = []
    for op in args.ops:
        for nbytes in stepped_sweep(args.max_bytes):
            sides = [ours_all[op](nbytes), raw_all[op](nbytes), control_all[op](nbytes), direct_all[op](nbytes)]
            for side in sides:
                side()  # warm-up: communicator setup, page faults
            logs = time_interleaved(sides, iterations_for_bytes(nbytes, 64 << 20, 20, 2000) * args.rounds, barrier)
            med_ours, med_raw, med_ctl, med_direct = (statistics.median(t) for t in logs)
            row = {"op": op, "bytes": nbytes, "spmd_s": med_ours, "raw_s": med_raw, "backend_s": med_direct,
                   "ratio": med_ours / med_raw, "control_ratio": med_ctl / med_raw,
                   "backend_ratio": med_direct / med_raw}
            results.append(row)
            if rank == 0 and not args.json:
                print(f"{op:24s} {human(nbytes):>8s} {med_ours * 1e6:10.1f} {med_raw * 1e6:10.1f} "
                      f"{row['ratio']:7.3f} {row['control_ratio']:8.3f} {med_direct * 1e6:10.1f} "
                      f"{row['backend_ratio']:11.3f}", flush=True)
    if rank == 0:
        if args.json:
            print(json.dumps(results, indent=1))
        else:
            summary(results)
    spmd.destroy_process_group()


def summary(results: list[dict]) -> None:
    for label, subset, target in (
        (f"sizes >= {human(LARGE_FROM)}", [r for r in results if r["bytes"] >= LARGE_FROM], TARGET_LARGE),
        ("4 B", [r for r in results if r["bytes"] == 4], TARGET_SMALL),
    ):
        if not subset:
            continue
        worst = max(subset, key=lambda r: r["ratio"])
        worst_backend = max(subset, key=lambda r: r["backend_ratio"])
        print(f"{label}: worst spmd/raw {worst['ratio']:.3f} ({worst['op']} {human(worst['bytes'])}), "
              f"worst backend/raw {worst_backend['backend_ratio']:.3f} ({worst_backend['op']} "
              f"{human(worst_backend['bytes'])}); target <= {target}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2, help="ranks to start when not already under mpiexec")
    parser.add_argument("--ops", type=lambda s: s.split(","), default=list(OPS))
    parser.add_argument("--max-bytes", type=int, default=64 << 20)
    parser.add_argument("--rounds", type=int, default=1, help="multiplies the calls per size; the median call is reported")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from spmd_mpi import probe

    if probe.launched_by_mpi():
        worker(args)
        return
    # Not under mpiexec: start this script again under the mpiexec that belongs to mpi4py's MPI.
    missing = probe.mpi4py_missing() or probe.library_missing()
    if missing:
        raise SystemExit(f"mpi_vs_mpi4py: {missing}")
    path, why = probe.find_mpiexec()
    if path is None:
        raise SystemExit(f"mpi_vs_mpi4py: {why}")
    # One mpiexec starts every rank; MASTER_* still name spmd's rendezvous store (MPI itself needs none).
    sys.exit(relaunch_locally(args.world_size, launcher=probe.mpiexec_command(args.world_size, path)))


if __name__ == "__main__":
    main()
