"""What the always-on mismatch check costs: all_reduce with it on and off, alternated call by call.

    python benchmarks/mismatch_check_cost.py               # 2 ranks: Gloo, MPI (if mpiexec is found), UCC
    python benchmarks/mismatch_check_cost.py --backends gloo

The check's hot-path part is one deque append per op (the flight recorder
keeps each group's recent calls; the watchdog thread compares them with a
peer's every 0.2 s) and a lookup of the call's shape among those the group's
ranks already agreed on (a new one is compared across ranks: once per shape,
before the op on Gloo, before its result is handed back on MPI and UCC; the
cost of a new one is printed too). Each rank times a 4 B and a 1 MiB ``spmd.all_reduce``
with the check on, off, and off again (the control), call by call in every
order in turn (so each precedes each other one equally often), each call after a little compute (a
128 x 128 matmul, as in a training loop), and prints the medians, their ratio
on/off and the median of the ratios of neighbouring calls (paired: slow drift
cancels) per size, and the same two ratios for the control: the noise floor. Goal: <= 1.02 at 4 B on every
backend, <= 1.01 at >= 1 MiB.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time

import torch

from spmd.bench.launch import relaunch_locally, rendezvous_env

SIZES = ((4, 6000), (1 << 20, 1800))  # (bytes, calls)
#: The check on, off, and off again: the control, whose ratio to off is how far two equal things differ here.
STATES = ("on", "off", "control")
ORDERS = list(itertools.permutations(STATES))


def worker(backend: str) -> None:
    import spmd
    from spmd.comm import lifecycle
    from spmd.debug.recorder import recorder

    torch.set_num_threads(1)
    spmd.init(backend, timeout=300)
    a, b = torch.randn(128, 128), torch.randn(128, 128)
    spmd.barrier()
    new_shape_costs = _time_new_shapes(spmd)
    rows = []
    for nbytes, calls in SIZES:
        t = torch.ones(nbytes // 4)
        for _ in range(50):
            spmd.all_reduce(t)
        times: dict[str, list[float]] = {state: [] for state in STATES}
        for i in range(calls):
            cycle, slot = divmod(i, len(STATES))
            state = ORDERS[cycle % len(ORDERS)][slot]  # every order in turn: each state precedes each other one equally often
            on = state == "on"
            recorder.keep_history = on
            lifecycle.agree_first_calls = on  # (off: the shape lookup is skipped too, for the measurement)
            torch.mm(a, b)
            start = time.perf_counter()
            spmd.all_reduce(t)
            times[state].append(time.perf_counter() - start)
        recorder.keep_history = True
        lifecycle.agree_first_calls = True
        medians = {state: statistics.median(values) for state, values in times.items()}
        # neighbours in time: slow drift cancels
        paired = {state: statistics.median(x / off for x, off in zip(times[state], times["off"])) for state in ("on", "control")}
        rows.append((nbytes, medians, paired))
    if spmd.get_rank() == 0:
        for nbytes, m, paired in rows:
            size = "4 B" if nbytes == 4 else f"{nbytes >> 20} MiB"
            print(f"{backend:5s} {size:>6s}  check on {m['on'] * 1e6:9.1f} us  off {m['off'] * 1e6:9.1f} us  "
                  f"on/off {m['on'] / m['off']:.3f}  paired {paired['on']:.3f}   "
                  f"control (off again)/off {m['control'] / m['off']:.3f}  paired {paired['control']:.3f}")
        new, repeated = new_shape_costs
        print(f"{backend:5s} a call shape new to the group (compared across ranks): {new * 1e6:9.1f} us, "
              f"the same call repeated {repeated * 1e6:9.1f} us (medians of 20)")
    spmd.destroy_process_group()


def _time_new_shapes(spmd) -> tuple[float, float]:
    """Median time of a 4 B all_reduce of a shape the group never saw (each one compared across the ranks),
    and of the same call repeated."""
    new, repeated = [], []
    for n in range(20):
        t = torch.ones(1000 + n)  # a new element count: a new call shape
        spmd.barrier()
        start = time.perf_counter()
        spmd.all_reduce(t)
        new.append(time.perf_counter() - start)
        spmd.barrier()
        start = time.perf_counter()
        spmd.all_reduce(t)
        repeated.append(time.perf_counter() - start)
    return statistics.median(new), statistics.median(repeated)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="gloo,mpi,ucc")
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    if "RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ or "PMI_RANK" in os.environ:
        worker(os.environ["SPMD_BENCH_BACKEND"])
        return
    status = 0
    for backend in args.backends.split(","):
        env = rendezvous_env(base={**os.environ, "SPMD_BENCH_BACKEND": backend})
        launcher = None
        if backend == "mpi":
            try:
                from spmd_mpi import probe
            except ImportError:
                print("mpi: spmd-mpi is not installed (pip install -e 'plugins/mpi'); skipped")
                continue
            path, why = probe.find_mpiexec()
            if path is None:
                print(f"mpi: skipped ({why})")
                continue
            launcher = probe.mpiexec_command(args.world_size, path)
        argv = [os.path.abspath(__file__), "--backends", backend]
        status = status or relaunch_locally(args.world_size, argv=argv, launcher=launcher, env=env)
    sys.exit(status)


if __name__ == "__main__":
    main()
