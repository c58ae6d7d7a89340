"""What only spmd-nccl has, checked on a GPU machine: stream semantics, CUDA graphs, splits, timeouts.

The collectives' results on CUDA tensors are the shared conformance suite's
(``spmd.testing.conformance``, run with ``device = "cuda"`` by
``plugins/nccl/tests/test_nccl_gpu.py``); these are the checks beside it:
unsupported reductions raise at the call, the backend's own gather and
barrier, and the GPU-only behaviour below.

Every function here runs on every rank of a World (``spmd.testing.World(n,
"cpu:gloo,cuda:nccl")``), pinned to GPU ``local rank % device_count`` by ``use_gpu``.
``plugins/nccl/tests/test_nccl_gpu.py`` and ``benchmarks/gpu`` both drive them.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import torch

import spmd
from spmd.comm.group import ProcessGroup
from spmd.comm.reduce_op import ReduceOp
from spmd.comm.state import NON_GROUP_MEMBER, get_state
from spmd.comm.work import as_work
from spmd.errors import CollectiveError, CollectiveTimeoutError
from spmd.testing.conformance.checks import Recorder
from spmd.testing.conformance.data import (
    DATA_DTYPES,
    REDUCE_DTYPES,
    make_input,
    same_bytes,
    valid_ops,
)
from spmd.testing.conformance.suite import device_under_test
from spmd_nccl.mapping import UnsupportedReduction


def use_gpu() -> torch.device:
    """Pin this rank to GPU ``local rank % device_count``, as the shared suite does (call first, on every rank)."""
    return device_under_test("cuda")


def _expect_bytes(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    if not same_bytes(actual, expected):  # (compared on the host, after wait() ordered the copy)
        raise AssertionError(f"{what}: data differs from the source")


def _roots(n: int) -> list[int]:
    return sorted({0, n - 1})


# -- what only NCCL has: checks beside the shared suite -------------------------------------------------
def check_unsupported_reductions_raise(g: ProcessGroup, rec: Recorder) -> None:
    """A pair NCCL cannot reduce (``supports_reduction`` False; the shared suite skips it) raises
    UnsupportedReduction naming the dtype and op at the call, instead of reaching NCCL."""
    backend = g.backend("cuda")
    for dtype in REDUCE_DTYPES:
        for op in valid_ops(dtype):
            if backend.supports_reduction(dtype, op):
                continue
            key = f"all_reduce/{dtype}/{op.name}/unsupported"

            def body(async_op: bool, dtype=dtype, op=op, key=key) -> None:  # type: ignore[no-untyped-def]
                t = make_input(g.rank, key, (7,), dtype, op).cuda()
                try:
                    spmd.all_reduce(t, op, group=g, async_op=async_op)
                except UnsupportedReduction as error:
                    if str(dtype).removeprefix("torch.") not in str(error) or op.name not in str(error):
                        raise AssertionError(f"{key}: the error does not name the pair: {error}") from error
                    return
                raise AssertionError(f"{key}: NCCL cannot do this pair, but no UnsupportedReduction was raised")

            rec.case(key, body)


def check_backend_gather(g: ProcessGroup, rec: Recorder) -> None:
    """NcclBackend.gather directly (spmd.gather stages its output on the host; see check_kernel_staging)."""
    n = g.size
    backend = g.backend("cuda")
    for dtype, root in itertools.product(DATA_DTYPES, _roots(n)):
        key = f"backend.gather/{dtype}/root{root}"
        inputs = [make_input(i, key, (3, 5), dtype) for i in range(n)]

        def body(async_op: bool, inputs=inputs, root=root, key=key) -> None:  # type: ignore[no-untyped-def]
            out = rec.zeros_like(torch.cat(inputs)) if g.rank == root else None
            as_work(backend.gather(out, inputs[g.rank].cuda(), root)).wait()
            if out is not None:
                _expect_bytes(out, torch.cat(inputs), key)

        rec.case(key, body)


def check_barrier(g: ProcessGroup, rec: Recorder) -> None:
    """NcclBackend.barrier blocks the CPU until every rank entered (spmd.barrier uses the CPU backend here)."""
    store = get_state().store
    backend = g.backend("cuda")
    for round_ in range(3):
        key = f"nccl-barrier/{g.name}/{round_}"

        def body(async_op: bool, key=key) -> None:  # type: ignore[no-untyped-def]
            store.set(f"{key}/{g.rank}", "1")
            as_work(backend.barrier()).wait()
            missing = [i for i in range(g.size) if not store.check([f"{key}/{i}"])]
            if missing:
                raise AssertionError(f"{key}: ranks {missing} had not arrived when the barrier returned")

        rec.case(key, body)


#: Checks of spmd-nccl itself (the collectives' results are the shared suite's: see test_nccl_gpu.py).
NCCL_CHECKS: dict[str, Callable[[ProcessGroup, Recorder], None]] = {
    "unsupported_reductions": check_unsupported_reductions_raise,
    "backend_gather": check_backend_gather,
    "barrier": check_barrier,
}


def run_nccl_checks() -> list[str]:
    """On every rank: pin the GPU and run NCCL_CHECKS on the world group; return the failures."""
    recorder = Recorder(use_gpu())
    group = get_state().world
    try:
        for check in NCCL_CHECKS.values():
            check(group, recorder)
    finally:
        torch.cuda.synchronize()
    return recorder.failures


# -- GPU-only behaviour -----------------------------------------------------------------------------
def check_stream_semantics() -> dict[str, float]:
    """wait() returns without blocking the CPU; is_completed() follows the event; the result is right."""
    device = use_gpu()
    n = spmd.get_world_size()
    x = torch.ones(1 << 20, device=device)
    spmd.all_reduce(x)  # the communicator exists before timing
    torch.cuda.synchronize()
    x.fill_(1.0)
    torch.cuda._sleep(int(2e8))  # keep the caller's stream busy for a while (~0.1 s)
    start = time.perf_counter()
    work = spmd.all_reduce(x, async_op=True)
    issued = time.perf_counter() - start
    if work is None:
        raise AssertionError("async_op=True returned no Work")
    if work.is_completed():
        raise AssertionError("the all_reduce reported completion while the caller's stream was still sleeping")
    start = time.perf_counter()
    work.wait()
    waited = time.perf_counter() - start
    y = x * 2  # on the caller's stream: must see the reduced values
    torch.cuda.synchronize()
    if not torch.all(y == 2 * n):
        raise AssertionError(f"after wait() the caller's stream saw {y[:4].tolist()}, expected {2 * n}")
    deadline = time.monotonic() + 5
    while not work.is_completed() and time.monotonic() < deadline:
        time.sleep(0.001)
    if not work.is_completed():
        raise AssertionError("is_completed() stayed False after the stream finished")
    if issued > 0.05 or waited > 0.05:
        raise AssertionError(f"the CPU blocked: issue took {issued:.3f} s and wait() {waited:.3f} s")
    return {"issue_s": issued, "wait_s": waited}


def check_cuda_graph() -> dict[str, float]:
    """Capture spmd.all_reduce in a CUDA graph, replay it twice, check the values; time replay vs eager."""
    device = use_gpu()
    n = spmd.get_world_size()
    static = torch.ones(1 << 16, device=device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the capture (creates the communicator)
        for _ in range(3):
            spmd.all_reduce(static)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    calls = 20
    with torch.cuda.graph(graph):
        for _ in range(calls):
            spmd.all_reduce(static)
    for value in (1.0, 2.0):
        static.fill_(value)
        graph.replay()
        torch.cuda.synchronize()
        expected = value * n**calls
        if not torch.all(static == expected):
            raise AssertionError(f"graph replay gave {static[:4].tolist()}, expected {expected}")
    start = time.perf_counter()
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    replay = (time.perf_counter() - start) / (10 * calls)
    start = time.perf_counter()
    for _ in range(10 * calls):
        spmd.all_reduce(static)
    torch.cuda.synchronize()
    eager = (time.perf_counter() - start) / (10 * calls)
    return {"graph_us_per_all_reduce": replay * 1e6, "eager_us_per_all_reduce": eager * 1e6}


def check_split_origin() -> dict[str, str]:
    """A sub-group of every rank comes from ncclCommSplit; one that leaves ranks out from a fresh unique id."""
    use_gpu()
    n = spmd.get_world_size()
    spmd.all_reduce(torch.ones(4, device="cuda"))  # the world communicator exists: split can use it
    everyone = spmd.new_group(list(range(n)))
    t = torch.ones(4, device="cuda")
    spmd.all_reduce(t, group=everyone)
    origins = {"all ranks": everyone.backend("cuda").communicator.origin}  # type: ignore[union-attr]
    if not torch.all(t.cpu() == n):
        raise AssertionError(f"all_reduce on the split group gave {t.tolist()}")
    spmd.destroy_process_group(everyone)
    if n > 1:
        evens = spmd.new_group(list(range(0, n, 2)))
        if evens is not NON_GROUP_MEMBER:
            t = torch.ones(4, device="cuda")
            spmd.all_reduce(t, group=evens)
            origins["evens"] = evens.backend("cuda").communicator.origin  # type: ignore[union-attr]
            if not torch.all(t.cpu() == len(range(0, n, 2))):
                raise AssertionError(f"all_reduce on the evens gave {t.tolist()}")
            spmd.destroy_process_group(evens)
    return origins


def check_timeout_aborts() -> str:
    """Rank 0 waits on an all_reduce (timeout=2) rank 1 never joins: a shorter wait(0.5) only ends that
    wait and leaves the communicator alive; the op's own deadline raises CollectiveTimeoutError and
    aborts the communicator, so a later op fails at once."""
    use_gpu()
    group = spmd.new_group(list(range(spmd.get_world_size())))
    spmd.all_reduce(torch.ones(4, device="cuda"), group=group)  # both ranks create the communicator
    torch.cuda.synchronize()
    if spmd.get_rank() != 0:
        time.sleep(8)  # never joins the second all_reduce
        spmd.destroy_process_group(group)
        return "skipped the op"
    communicator = group.backend("cuda").communicator  # type: ignore[union-attr]
    start = time.perf_counter()
    work = spmd.all_reduce(torch.ones(4, device="cuda"), group=group, async_op=True, timeout=2)
    assert work is not None
    try:
        work.wait(timeout=0.5)
    except CollectiveTimeoutError:
        if communicator.error is not None:
            raise AssertionError(f"a wait shorter than the op's timeout aborted the communicator: {communicator.error}") from None
    else:
        raise AssertionError("wait(timeout=0.5) returned although the peer never joined")
    try:
        work.wait(timeout=30)
    except CollectiveTimeoutError as error:
        took = time.perf_counter() - start
        if not 1.5 <= took <= 15:
            raise AssertionError(f"the op's 2 s timeout fired after {took:.1f} s") from error
    else:
        raise AssertionError("the op completed although the peer never joined")
    try:
        spmd.all_reduce(torch.ones(4, device="cuda"), group=group)
    except CollectiveTimeoutError as error:
        if "aborted" not in str(error):
            raise AssertionError(f"the later op's error does not say the communicator was aborted: {error}") from error
    except CollectiveError as error:
        raise AssertionError(f"the later op raised {type(error).__name__}, not CollectiveTimeoutError: {error}") from error
    else:
        raise AssertionError("an op on the aborted group did not raise")
    spmd.destroy_process_group(group)
    return "timed out and aborted"


def check_kernel_staging() -> list[str]:
    """The API paths that stage through the kernel's buffer pool (list forms, non-contiguous, gather).

    The pool allocates on the tensor's device; a staging buffer in host memory
    would make NCCL (rightly) refuse it, and each such case is returned as a failure.
    """
    use_gpu()
    n = spmd.get_world_size()
    failures = []
    cases: dict[str, Callable[[], None]] = {
        "all_gather (list)": lambda: spmd.all_gather([torch.zeros(3, device="cuda") for _ in range(n)], torch.ones(3, device="cuda")),
        "reduce_scatter (list)": lambda: spmd.reduce_scatter(torch.zeros(3, device="cuda"), [torch.ones(3, device="cuda") for _ in range(n)]),
        "all_to_all (list)": lambda: spmd.all_to_all([torch.zeros(2, device="cuda") for _ in range(n)], [torch.ones(2, device="cuda") for _ in range(n)]),
        "all_reduce (non-contiguous)": lambda: spmd.all_reduce(torch.ones(4, 6, device="cuda")[:, ::2]),
    }
    if n == 1:  # with peers, the root would fail while the others' sends stay posted
        cases["gather"] = lambda: spmd.gather(torch.ones(3, device="cuda"), [torch.zeros(3, device="cuda")], dst=0)
    for name, call in cases.items():
        try:
            call()
            torch.cuda.synchronize()
        except Exception as error:  # noqa: BLE001 - the failure is the result
            failures.append(f"{name}: {type(error).__name__}: {str(error).splitlines()[0][:200]}")
    return failures


# -- benchmark ------------------------------------------------------------------------------------
def _max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    spmd.all_reduce(t, op=ReduceOp.MAX)  # a CPU tensor: the group's CPU backend (Gloo)
    return float(t.item())


def _time_calls(op: Callable[[], object], iters: int) -> float:
    """Seconds per call of ``iters`` back-to-back calls, the GPU drained before and after (max over ranks)."""
    torch.cuda.synchronize()
    spmd.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        op()
    torch.cuda.synchronize()
    return _max_over_ranks((time.perf_counter() - start) / iters)


def bench_all_reduce(sizes: list[int], rounds: int = 3, target_s: float = 0.15) -> list[dict[str, float]]:
    """all_reduce (SUM, float32, in place) per size: spmd on NCCL, torch.distributed's own NCCL
    process group, and the bare ``ncclAllReduce`` through ctypes on spmd's communicator.

    Each measurement times back-to-back calls (launch overhead overlaps the GPU,
    as in a training step), the slowest rank's time counts, the three
    alternate in rotating order over ``rounds``, and the median round is kept.
    """
    import torch.distributed as tdist

    from spmd_nccl.mapping import ncclFloat32, ncclSum

    device = use_gpu()
    n, rank = spmd.get_world_size(), spmd.get_rank()
    if not tdist.is_initialized():
        store = tdist.PrefixStore("bench/torch-nccl/", get_state().store)
        tdist.init_process_group("nccl", store=store, rank=rank, world_size=n, device_id=device)
    # Under spmd's torch interop the default group is spmd's own: compare with torch's NCCL group.
    nccl = None if tdist.get_backend() == "nccl" else tdist.new_group(backend="nccl", device_id=device)
    rows = []
    for size in sizes:
        numel = max(1, size // 4)
        buf = torch.zeros(numel, device=device)
        spmd.all_reduce(buf)
        tdist.all_reduce(buf, group=nccl)
        comm = get_state().world.backend("cuda").communicator  # type: ignore[attr-defined]
        lib, ptr = comm.lib, buf.data_ptr()

        def raw(lib=lib, ptr=ptr, comm=comm, numel=numel) -> int:  # type: ignore[no-untyped-def]
            return lib.ncclAllReduce(ptr, ptr, numel, ncclFloat32, ncclSum, comm.handle, comm.stream_handle)

        def ours(buf: torch.Tensor = buf) -> object:
            return spmd.all_reduce(buf)

        def theirs(buf: torch.Tensor = buf) -> object:
            return tdist.all_reduce(buf, group=nccl)

        result = raw()
        if result != 0:
            raise AssertionError(f"ncclAllReduce through ctypes failed: {lib.describe(result, comm.handle)}")
        ops: dict[str, Callable[[], object]] = {"spmd": ours, "torch": theirs, "raw": raw}
        probe = max(_time_calls(op, 3) for op in ops.values())
        iters = int(min(max(target_s / max(probe, 1e-7), 5), 2000))
        times: dict[str, list[float]] = {name: [] for name in ops}
        names = list(ops)
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                times[name].append(_time_calls(ops[name], iters))
        med = {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}
        factor = 2 * (n - 1) / n if n > 1 else 1.0  # bus bandwidth (algorithm bandwidth for one rank)
        rows.append({
            "bytes": float(numel * 4),
            "iters": float(iters),
            "spmd_us": med["spmd"] * 1e6,
            "torch_us": med["torch"] * 1e6,
            "raw_us": med["raw"] * 1e6,
            "spmd_over_torch": med["spmd"] / med["torch"],
            "spmd_busbw_GBps": numel * 4 * factor / med["spmd"] / 1e9,
            "torch_busbw_GBps": numel * 4 * factor / med["torch"] / 1e9,
        })
        del buf
        torch.cuda.empty_cache()
    return rows
