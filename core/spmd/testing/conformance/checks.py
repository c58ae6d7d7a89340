"""One check per operation: run every case on every rank and compare with the local oracle.

A check returns the failures it saw (AssertionError messages) rather than
raising at the first one, so one bad dtype does not hide the others and the
ranks stay in step. Anything other than a wrong result (an exception from the
op itself) propagates and fails the rank with its traceback.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable, Iterator

import torch

import spmd
from spmd.comm.group import ProcessGroup
from spmd.comm.reduce_op import ReduceOp
from spmd.comm.state import get_state
from spmd.testing.conformance.data import (
    DATA_DTYPES,
    LARGE_DTYPES,
    LARGE_SHAPE,
    REDUCE_DTYPES,
    SHAPES,
    check_reduced,
    expected_reduce,
    make_input,
    rounding_bound,
    same_bytes,
    strided,
    valid_ops,
)


class Recorder:
    """Runs cases, alternating sync and async calls, and keeps their failures.

    ``device`` is where the cases' tensors live (the device of the backend under
    test); ``reduces(dtype, op)`` says which reductions that backend takes
    (``Backend.supports_reduction``): the others are not its to run.
    """

    def __init__(self, device: torch.device | str = "cpu", reduces: Callable[[torch.dtype, ReduceOp], bool] | None = None) -> None:
        self.failures: list[str] = []
        self.count = 0
        self.device = torch.device(device)
        self.reduces: Callable[[torch.dtype, ReduceOp], bool] = reduces or (lambda dtype, op: True)

    def put(self, host: torch.Tensor) -> torch.Tensor:
        """A copy of host tensor ``host`` on the device under test."""
        return host.to(self.device, copy=True)

    def strided(self, host: torch.Tensor) -> torch.Tensor:
        """A non-contiguous tensor on the device under test equal to ``host``."""
        return strided(host, self.device)

    def zeros_like(self, like: torch.Tensor) -> torch.Tensor:
        """Zeros shaped like host tensor ``like``, on the device (made on the host: every dtype)."""
        return torch.zeros_like(like).to(self.device)

    def zeros(self, shape: tuple[int, ...] | int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype).to(self.device)

    def reductions(self, dtype: torch.dtype) -> tuple[ReduceOp, ...]:
        """The reduce ops the suite checks on ``dtype`` with this backend."""
        return tuple(op for op in valid_ops(dtype) if self.reduces(dtype, op))

    def next_async(self) -> bool:
        self.count += 1
        return self.count % 2 == 0

    def case(self, name: str, body: Callable[[bool], None]) -> None:
        async_op = self.next_async()
        try:
            body(async_op)
        except AssertionError as error:
            self.failures.append(f"{name} (async={async_op}): {error}")


def _done(work: spmd.Work | None) -> None:
    if work is not None:
        work.wait()


def _expect_bytes(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    if not same_bytes(actual, expected):
        raise AssertionError(f"{what}: data differs from the source")


def _layouts() -> Iterator[tuple[tuple[int, ...], bool]]:
    for shape in SHAPES:
        yield shape, False
    yield (3, 5), True  # non-contiguous


def _roots(n: int) -> list[int]:
    return sorted({0, n - 1})


# -- reductions ----------------------------------------------------------------------
def check_all_reduce(g: ProcessGroup, rec: Recorder) -> None:
    cases = [(d, op, s, nc) for d in REDUCE_DTYPES for op in rec.reductions(d) for s, nc in _layouts()]
    cases += [(d, op, LARGE_SHAPE, False) for d in LARGE_DTYPES for op in (ReduceOp.SUM, ReduceOp.MAX) if rec.reduces(d, op)]
    for dtype, op, shape, noncontig in cases:
        key = f"all_reduce/{dtype}/{op.name}/{shape}/{noncontig}"
        inputs = [make_input(i, key, shape, dtype, op) for i in range(g.size)]

        def body(async_op: bool, inputs: list[torch.Tensor] = inputs, op: ReduceOp = op, noncontig: bool = noncontig, key: str = key) -> None:
            t = rec.strided(inputs[g.rank]) if noncontig else rec.put(inputs[g.rank])
            _done(spmd.all_reduce(t, op, group=g, async_op=async_op))
            check_reduced(t, expected_reduce(inputs, op), key, rounding_bound(inputs, op))

        rec.case(key, body)
    _check_storage_dtype_reductions(g, rec)
    _check_avg_that_would_overflow(g, rec)


#: dtypes torch stores but has no CPU arithmetic for (the kernels reduce them in a wider dtype), with the
#: ops checked on each (float8: small sums, exact in every float8 format).
STORAGE_REDUCTIONS = (
    *((d, (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR))
      for d in (torch.uint16, torch.uint32, torch.uint64)),
    *((d, (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MIN, ReduceOp.MAX)) for d in (torch.float8_e4m3fn, torch.float8_e5m2)),
)


def _check_storage_dtype_reductions(g: ProcessGroup, rec: Recorder) -> None:
    """all_reduce on uint16/32/64 and float8: the right value on every rank (these once failed on the
    rank that reduced, while the others reported success or waited)."""
    for dtype, ops in STORAGE_REDUCTIONS:
        for op in (op for op in ops if rec.reduces(dtype, op)):
            key = f"all_reduce/{dtype}/{op.name}/storage"
            if dtype.is_floating_point:  # 0 or 1 each: every sum and mean below is exact in float8
                inputs = [make_input(i, key, (7,), torch.bool).to(dtype) for i in range(g.size)]
            else:
                inputs = [make_input(i, key, (7,), dtype, op) for i in range(g.size)]

            def body(async_op: bool, inputs: list[torch.Tensor] = inputs, op: ReduceOp = op, key: str = key) -> None:
                t = rec.put(inputs[g.rank])
                _done(spmd.all_reduce(t, op, group=g, async_op=async_op))
                _expect_bytes(t, expected_reduce(inputs, op), key)

            rec.case(key, body)


def _check_avg_that_would_overflow(g: ProcessGroup, rec: Recorder) -> None:
    """float16 AVG of 60000 on every rank: the sum overflows float16, the mean does not (all_reduce,
    reduce, reduce_scatter_tensor give 60000, as NCCL's ncclAvg; summing first gave inf)."""
    if not rec.reduces(torch.float16, ReduceOp.AVG):
        return
    big = torch.full((6,), 60000.0, dtype=torch.float16)
    avg = ReduceOp.AVG

    def body(async_op: bool) -> None:
        t = rec.put(big)
        _done(spmd.all_reduce(t, avg, group=g, async_op=async_op))
        _expect_bytes(t, big, "all_reduce AVG of 60000 in float16")
        kept = rec.put(big)  # the root's gets the mean; every other rank's stays as it was
        _done(spmd.reduce(kept, op=avg, group_dst=0, group=g, async_op=async_op))
        _expect_bytes(kept, big, "reduce AVG of 60000 in float16")
        source, out = rec.put(big[:1].repeat(g.size * 2)), rec.zeros(2, torch.float16)
        _done(spmd.reduce_scatter_tensor(out, source, avg, group=g, async_op=async_op))
        _expect_bytes(out, big[:2], "reduce_scatter_tensor AVG of 60000 in float16")
        _expect_bytes(source, big[:1].repeat(g.size * 2), "reduce_scatter_tensor's input after AVG")

    rec.case("all_reduce/float16/AVG/overflowing_sum", body)


def check_reduce(g: ProcessGroup, rec: Recorder) -> None:
    for dtype, root in itertools.product(REDUCE_DTYPES, _roots(g.size)):
        for op in rec.reductions(dtype):
            for shape, noncontig in [((7,), False), ((3, 5), True), ((0,), False)]:
                key = f"reduce/{dtype}/{op.name}/{shape}/{noncontig}/root{root}"
                inputs = [make_input(i, key, shape, dtype, op) for i in range(g.size)]

                def body(async_op: bool, inputs=inputs, op=op, noncontig=noncontig, key=key, root=root) -> None:  # type: ignore[no-untyped-def]
                    t = rec.strided(inputs[g.rank]) if noncontig else rec.put(inputs[g.rank])
                    _done(spmd.reduce(t, group_dst=root, op=op, group=g, async_op=async_op))
                    if g.rank == root:
                        check_reduced(t, expected_reduce(inputs, op), key, rounding_bound(inputs, op))
                    else:  # the contract: only the root's tensor changes
                        _expect_bytes(t, inputs[g.rank], f"{key}: a non-root rank's tensor after reduce")

                rec.case(key, body)


def check_reduce_scatter_tensor(g: ProcessGroup, rec: Recorder) -> None:
    n = g.size
    for dtype in REDUCE_DTYPES:
        for op in rec.reductions(dtype):
            for rows, stacked in [(0, False), (1, False), (5, False), (2, True)]:
                key = f"reduce_scatter_tensor/{dtype}/{op.name}/{rows}/{stacked}"
                shape = (n, rows, 3) if stacked else (n * rows, 3)
                inputs = [make_input(i, key, shape, dtype, op) for i in range(n)]

                def body(async_op: bool, inputs=inputs, op=op, key=key, rows=rows, stacked=stacked) -> None:  # type: ignore[no-untyped-def]
                    out = rec.zeros((rows, 3), inputs[0].dtype)
                    _done(spmd.reduce_scatter_tensor(out, rec.put(inputs[g.rank]), op, group=g, async_op=async_op))
                    full = expected_reduce(inputs, op).reshape(n, rows, 3)
                    check_reduced(out, full[g.rank], key, rounding_bound(inputs, op))

                rec.case(key, body)
    for dtype in (d for d in LARGE_DTYPES if rec.reduces(d, ReduceOp.SUM)):
        key = f"reduce_scatter_tensor/{dtype}/SUM/large"
        inputs = [make_input(i, key, (n * 20000,), dtype) for i in range(n)]

        def large(async_op: bool, inputs=inputs, key=key) -> None:  # type: ignore[no-untyped-def]
            out = rec.zeros(20000, inputs[0].dtype)
            _done(spmd.reduce_scatter_tensor(out, rec.put(inputs[g.rank]), ReduceOp.SUM, group=g, async_op=async_op))
            check_reduced(out, expected_reduce(inputs, ReduceOp.SUM).chunk(n)[g.rank], key)

        rec.case(key, large)


def check_reduce_scatter(g: ProcessGroup, rec: Recorder) -> None:
    n = g.size
    for dtype in (torch.float32, torch.int64, torch.bool, torch.bfloat16):
        for op in rec.reductions(dtype)[:3]:
            key = f"reduce_scatter/{dtype}/{op.name}"
            inputs = [[make_input(i, f"{key}/{j}", (2, 3), dtype, op) for j in range(n)] for i in range(n)]

            def body(async_op: bool, inputs=inputs, op=op, key=key, dtype=dtype) -> None:  # type: ignore[no-untyped-def]
                out = rec.zeros((2, 3), dtype)
                _done(spmd.reduce_scatter(out, [rec.put(x) for x in inputs[g.rank]], op, group=g, async_op=async_op))
                check_reduced(out, expected_reduce([inputs[i][g.rank] for i in range(n)], op), key, rounding_bound([inputs[i][g.rank] for i in range(n)], op))

            rec.case(key, body)


# -- data movement -------------------------------------------------------------------
def check_broadcast(g: ProcessGroup, rec: Recorder) -> None:
    for dtype, root, (shape, noncontig) in itertools.product(DATA_DTYPES, _roots(g.size), _layouts()):
        key = f"broadcast/{dtype}/{shape}/{noncontig}/root{root}"
        source = make_input(root, key, shape, dtype)

        def body(async_op: bool, source=source, root=root, noncontig=noncontig, key=key) -> None:  # type: ignore[no-untyped-def]
            mine = source if g.rank == root else torch.zeros_like(source)
            t = rec.strided(mine) if noncontig else rec.put(mine)
            _done(spmd.broadcast(t, group_src=root, group=g, async_op=async_op))
            _expect_bytes(t, source, key)

        rec.case(key, body)
    for dtype in LARGE_DTYPES:
        key = f"broadcast/{dtype}/large"
        source = make_input(0, key, LARGE_SHAPE, dtype)

        def large(async_op: bool, source=source, key=key) -> None:  # type: ignore[no-untyped-def]
            t = rec.put(source) if g.rank == 0 else rec.zeros_like(source)
            _done(spmd.broadcast(t, group_src=0, group=g, async_op=async_op))
            _expect_bytes(t, source, key)

        rec.case(key, large)


def check_all_gather_into_tensor(g: ProcessGroup, rec: Recorder) -> None:
    n = g.size
    layouts = [(s, nc, stack) for s, nc in _layouts() for stack in (False, True)]
    cases = [(d, s, nc, st) for d in DATA_DTYPES for s, nc, st in layouts]
    cases += [(d, LARGE_SHAPE, False, False) for d in LARGE_DTYPES]
    for dtype, shape, noncontig, stack in cases:
        key = f"all_gather_into_tensor/{dtype}/{shape}/{noncontig}/stack={stack}"
        inputs = [make_input(i, key, shape, dtype) for i in range(n)]
        expected = torch.stack(inputs) if stack else torch.cat(inputs)

        def body(async_op: bool, inputs=inputs, expected=expected, noncontig=noncontig, key=key) -> None:  # type: ignore[no-untyped-def]
            out = rec.zeros_like(expected)
            mine = rec.strided(inputs[g.rank]) if noncontig else rec.put(inputs[g.rank])
            _done(spmd.all_gather_into_tensor(out, mine, group=g, async_op=async_op))
            _expect_bytes(out, expected, key)

        rec.case(key, body)


def check_all_gather(g: ProcessGroup, rec: Recorder) -> None:
    n = g.size
    for dtype, shape in itertools.product(DATA_DTYPES, [(0,), (3, 5), (1000,)]):
        key = f"all_gather/{dtype}/{shape}"
        inputs = [make_input(i, key, shape, dtype) for i in range(n)]

        def body(async_op: bool, inputs=inputs, key=key) -> None:  # type: ignore[no-untyped-def]
            outs = [rec.zeros_like(inputs[0]) for _ in range(n)]
            _done(spmd.all_gather(outs, rec.put(inputs[g.rank]), group=g, async_op=async_op))
            for i in range(n):
                _expect_bytes(outs[i], inputs[i], f"{key}[{i}]")

        rec.case(key, body)


def _uneven_splits(n: int) -> list[list[int]]:
    """splits[i][j]: rows rank i sends to rank j (0, 1 or 2; some zero)."""
    return [[(i + 2 * j) % 3 for j in range(n)] for i in range(n)]


def _idle_splits(n: int) -> list[list[int]]:
    """Rank 0 sends and receives nothing while the others exchange rows (every rank must still take part)."""
    return [[0 if 0 in (i, j) else (i + j) % 3 + 1 for j in range(n)] for i in range(n)]


def check_all_to_all_single(g: ProcessGroup, rec: Recorder) -> None:
    n, r = g.size, g.rank
    for dtype, pattern, noncontig in itertools.product(DATA_DTYPES, ("even", "uneven", "idle"), (False, True)):
        key = f"all_to_all_single/{dtype}/{pattern}/noncontig={noncontig}"
        uneven = pattern != "even"
        splits = {"even": [[2] * n for _ in range(n)], "uneven": _uneven_splits(n), "idle": _idle_splits(n)}[pattern]
        inputs = [make_input(i, key, (sum(splits[i]), 4), dtype) for i in range(n)]
        blocks = [list(inputs[i].split(splits[i])) for i in range(n)]
        expected = torch.cat([blocks[j][r] for j in range(n)])

        def body(async_op: bool, inputs=inputs, splits=splits, expected=expected, key=key, uneven=uneven, noncontig=noncontig) -> None:  # type: ignore[no-untyped-def]
            out = rec.zeros_like(expected)
            mine = rec.strided(inputs[r]) if noncontig and inputs[r].numel() else rec.put(inputs[r])
            in_splits = splits[r] if uneven else None
            out_splits = [splits[j][r] for j in range(n)] if uneven else None
            _done(spmd.all_to_all_single(out, mine, out_splits, in_splits, group=g, async_op=async_op))
            _expect_bytes(out, expected, key)

        rec.case(key, body)


def check_all_to_all(g: ProcessGroup, rec: Recorder) -> None:
    n, r = g.size, g.rank
    splits = _uneven_splits(n)
    for dtype in (torch.float32, torch.int16, torch.bool, torch.bfloat16):
        key = f"all_to_all/{dtype}"
        inputs = [[make_input(i, f"{key}/{j}", (splits[i][j], 2), dtype) for j in range(n)] for i in range(n)]

        def body(async_op: bool, inputs=inputs, key=key) -> None:  # type: ignore[no-untyped-def]
            outs = [rec.zeros_like(inputs[j][r]) for j in range(n)]
            _done(spmd.all_to_all(outs, [rec.put(x) for x in inputs[r]], group=g, async_op=async_op))
            for j in range(n):
                _expect_bytes(outs[j], inputs[j][r], f"{key} from {j}")

        rec.case(key, body)


def check_gather(g: ProcessGroup, rec: Recorder) -> None:
    n = g.size
    for dtype, root, shape in itertools.product(DATA_DTYPES, _roots(n), [(0,), (3, 5)]):
        key = f"gather/{dtype}/{shape}/root{root}"
        inputs = [make_input(i, key, shape, dtype) for i in range(n)]

        def body(async_op: bool, inputs=inputs, root=root, key=key) -> None:  # type: ignore[no-untyped-def]
            slots = [rec.zeros_like(inputs[0]) for _ in range(n)] if g.rank == root else None
            _done(spmd.gather(rec.put(inputs[g.rank]), slots, group_dst=root, group=g, async_op=async_op))
            if slots is not None:
                for i in range(n):
                    _expect_bytes(slots[i], inputs[i], f"{key}[{i}]")

        rec.case(key, body)


def check_scatter(g: ProcessGroup, rec: Recorder) -> None:
    n = g.size
    for dtype, root, shape in itertools.product(DATA_DTYPES, _roots(n), [(0,), (3, 5)]):
        key = f"scatter/{dtype}/{shape}/root{root}"
        pieces = [make_input(i, key, shape, dtype) for i in range(n)]

        def body(async_op: bool, pieces=pieces, root=root, key=key) -> None:  # type: ignore[no-untyped-def]
            out = rec.zeros_like(pieces[0])
            _done(spmd.scatter(out, [rec.put(p) for p in pieces] if g.rank == root else None, group_src=root, group=g, async_op=async_op))
            _expect_bytes(out, pieces[g.rank], key)

        rec.case(key, body)


def check_barrier(g: ProcessGroup, rec: Recorder) -> None:
    """After the barrier every rank's pre-barrier mark must be visible in the store."""
    store = get_state().store
    token = [uuid.uuid4().hex]
    spmd.broadcast_object_list(token, group=g, group_src=0)
    for round_ in range(4):
        key = f"barrier/{token[0]}/{round_}"

        def body(async_op: bool, key=key) -> None:  # type: ignore[no-untyped-def]
            store.add(f"{key}/{g.rank}", 1)  # add waits for the server; TCPStore.set does not
            _done(spmd.barrier(group=g, async_op=async_op))
            missing = [i for i in range(g.size) if not store.check([f"{key}/{i}"])]
            if missing:
                raise AssertionError(f"{key}: ranks {missing} had not arrived when the barrier returned")

        rec.case(key, body)


def check_p2p(g: ProcessGroup, rec: Recorder) -> None:
    """Ring exchange with isend/irecv, ordered messages on one tag, and batch_isend_irecv."""
    n, r = g.size, g.rank
    if n == 1:
        return
    right, left = (r + 1) % n, (r - 1) % n
    for dtype, (shape, noncontig) in itertools.product(DATA_DTYPES, _layouts()):
        key = f"p2p/{dtype}/{shape}/{noncontig}"
        inputs = [make_input(i, key, shape, dtype) for i in range(n)]

        def body(async_op: bool, inputs=inputs, key=key, noncontig=noncontig) -> None:  # type: ignore[no-untyped-def]
            zeros = torch.zeros_like(inputs[0])
            target = rec.strided(zeros) if noncontig else rec.put(zeros)
            if async_op:
                works = spmd.batch_isend_irecv(
                    [spmd.P2POp(spmd.isend, rec.put(inputs[r]), group_peer=right, group=g, tag=3),
                     spmd.P2POp(spmd.irecv, target, group_peer=left, group=g, tag=3)]
                )
                for w in works:
                    w.wait()
            else:
                recv = spmd.irecv(target, group=g, group_src=left, tag=3)
                spmd.isend(rec.put(inputs[r]), group=g, group_dst=right, tag=3).wait()
                recv.wait()
            _expect_bytes(target, inputs[left], key)

        rec.case(key, body)

    def ordered(async_op: bool) -> None:
        sends = [spmd.isend(torch.full((4,), float(k), device=rec.device), group=g, group_dst=right, tag=7) for k in range(5)]
        got = [torch.zeros(4, device=rec.device) for _ in range(5)]
        for k in range(5):
            spmd.recv(got[k], group=g, group_src=left, tag=7)
        for w in sends:
            w.wait()
        if [int(t[0]) for t in got] != list(range(5)):
            raise AssertionError(f"messages on one tag arrived out of order: {[int(t[0]) for t in got]}")

    rec.case("p2p/order", ordered)

    def beside_monitored_barrier(async_op: bool) -> None:
        # A receive posted before a monitored_barrier gets the message sent after it (the barrier's own
        # traffic must not reach, or take, the program's messages: it once shared tag 0 with them).
        got = torch.zeros(4, device=rec.device)
        recv = spmd.irecv(got, group=g, group_src=left, tag=0)
        spmd.monitored_barrier(group=g)
        spmd.isend(torch.full((4,), 42.0 + r, device=rec.device), group=g, group_dst=right, tag=0).wait()
        recv.wait()
        if got.tolist() != [42.0 + left] * 4:
            raise AssertionError(f"a receive posted before monitored_barrier got {got.tolist()}, not rank {left}'s message {42.0 + left}")

    rec.case("p2p/monitored_barrier", beside_monitored_barrier)


def check_objects(g: ProcessGroup, rec: Recorder) -> None:
    n, r = g.size, g.rank

    def objects(rank: int) -> dict:
        return {"rank": rank, "payload": list(range(rank * 50)), "name": "x" * rank}

    def gather_all(async_op: bool) -> None:
        out: list = [None] * n
        spmd.all_gather_object(out, objects(r), group=g)
        if out != [objects(i) for i in range(n)]:
            raise AssertionError(f"all_gather_object: {out}")

    def broadcast(async_op: bool) -> None:
        for root in _roots(n):
            items = [objects(root), "tail"] if r == root else [None, None]
            spmd.broadcast_object_list(items, group=g, group_src=root)
            if items != [objects(root), "tail"]:
                raise AssertionError(f"broadcast_object_list from {root}: {items}")

    def gather(async_op: bool) -> None:
        for root in _roots(n):
            out = [None] * n if r == root else None
            spmd.gather_object(objects(r), out, group=g, group_dst=root)
            if out is not None and out != [objects(i) for i in range(n)]:
                raise AssertionError(f"gather_object to {root}: {out}")

    def scatter(async_op: bool) -> None:
        for root in _roots(n):
            out: list = [None]
            spmd.scatter_object_list(out, [objects(i) for i in range(n)] if r == root else None, group=g, group_src=root)
            if out[0] != objects(r):
                raise AssertionError(f"scatter_object_list from {root}: {out}")

    for name, fn in [("all_gather_object", gather_all), ("broadcast_object_list", broadcast), ("gather_object", gather), ("scatter_object_list", scatter)]:
        rec.case(name, fn)


CHECKS: dict[str, Callable[[ProcessGroup, Recorder], None]] = {
    "all_reduce": check_all_reduce,
    "reduce": check_reduce,
    "reduce_scatter_tensor": check_reduce_scatter_tensor,
    "reduce_scatter": check_reduce_scatter,
    "broadcast": check_broadcast,
    "all_gather_into_tensor": check_all_gather_into_tensor,
    "all_gather": check_all_gather,
    "all_to_all_single": check_all_to_all_single,
    "all_to_all": check_all_to_all,
    "gather": check_gather,
    "scatter": check_scatter,
    "barrier": check_barrier,
    "p2p": check_p2p,
    "objects": check_objects,
}
