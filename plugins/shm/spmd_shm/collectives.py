"""The shm collectives, as generators the engine steps: chunk by chunk through the rank slots.

Each chunk is one round (see ``spmd_shm.rounds``): the writers copy into their slot, everyone
publishes, the readers copy or reduce out of the slots they need, everyone acks. Reductions read
the slots in rank order on every rank, so all ranks get bit-identical results. Large tensors go
through the slots one slot-sized chunk after another; with two slots per rank the copy-in of
chunk i+1 does not wait for the slowest reader of chunk i.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

from spmd.comm.reduce_op import ReduceOp, finish_avg, reduce_into
from spmd.errors import CollectiveError
from spmd_shm.peers import Steps, any_below
from spmd_shm.rounds import Rounds
from spmd_shm.work import ShmWork

_SPLIT = "all_reduce (split)"
#: Codes that identify the op in a slot's signature (with the op's total byte count).
_CODES = {"all_reduce": 1, "reduce": 2, "broadcast": 3, "all_gather_into_tensor": 4, "gather": 5,
          "reduce_scatter_tensor": 6, "scatter": 7, "barrier": 8, "all_to_all_single": 9, _SPLIT: 10}
_SIZE_BITS = (1 << 56) - 1
#: all_reduce of at least this many bytes, in a group of at least this many ranks: each rank reduces 1/N of
#: every chunk (reduce-scatter), then copies the others' reduced slices (all-gather), instead of every rank
#: reducing every chunk whole. That moves less memory but adds a synchronisation per chunk. Measured on the
#: loaded 2-core host, split / whole back to back (paired blocks, medians): 2 ranks 1.24-1.30 at 1 MiB,
#: 0.99-1.07 at 4 MiB, 0.96-1.05 at 16 MiB (no gain); 3 ranks 0.87-1.14 and 0.99-1.00; 4 ranks 0.89 and
#: 0.73-0.81 (see the README).
SPLIT_BYTES = int(os.environ.get("SPMD_SHM_SPLIT_BYTES", str(4 << 20)))
SPLIT_RANKS = int(os.environ.get("SPMD_SHM_SPLIT_RANKS", "4"))
_LINE = 64  # elements per slice at least (the slices are cut at cache lines)


def sign(eng: Rounds, r: int, op: str, total: int) -> None:
    """Record which op (and how many bytes in all) this rank's round-``r`` slot belongs to."""
    eng.slot_sig[eng.me][r & 1].value = (_CODES[op] << 56) | total


def check_op(eng: Rounds, r: int, ranks: list[int], op: str, total: int, same_total: bool = True) -> None:
    """Raise a named error if a peer's round-``r`` slot belongs to another op (or, with ``same_total``, to
    the same op on another byte count) than this rank's."""
    mine = (_CODES[op] << 56) | total
    for q in ranks:
        sig = eng.slot_sig[q][r & 1].value
        if sig != mine and (same_total or sig >> 56 != _CODES[op]):
            names = {code: name for name, code in _CODES.items()}
            if {names.get(sig >> 56), op} == {"all_reduce", _SPLIT}:
                raise CollectiveError(
                    f"shm: this rank and {eng.names([q])} chose different all_reduce paths for {total} bytes "
                    f"(this rank: {op}); SPMD_SHM_SPLIT_BYTES and SPMD_SHM_SPLIT_RANKS must be the same on every rank"
                )
            raise CollectiveError(
                f"shm: this rank called {op} on {total} bytes but {eng.names([q])} called "
                f"{names.get(sig >> 56, 'another op')} on {sig & _SIZE_BITS} bytes at the same point; every rank of "
                "the group must make the same collective calls, in the same order, with tensors of the same shape and dtype"
            )


def _write(eng: Rounds, r: int, parts: list[torch.Tensor]) -> None:
    """Copy ``parts`` (of one dtype) back to back into this rank's slot for round ``r``; record the byte count."""
    offset = 0
    for part in parts:
        count = part.numel()
        if count:
            eng.view(eng.me, r, part.dtype, offset, count).copy_(part)
        offset += count
    eng.slot_size[eng.me][r & 1].value = offset * parts[0].element_size() if parts else 0


def _read(eng: Rounds, q: int, r: int, dtype: torch.dtype, start: int, count: int) -> torch.Tensor:
    """Elements ``start:start+count`` (of ``dtype``) of rank ``q``'s slot for round ``r``."""
    return eng.view(q, r, dtype, start, count)


def _check_sizes(eng: Rounds, r: int, ranks: list[int], nbytes: int, op: str, total: int) -> None:
    """Raise a named error if a peer's slot holds another op, or another size, than this rank's."""
    check_op(eng, r, ranks, op, total)
    for q in ranks:
        theirs = eng.slot_size[q][r & 1].value
        if theirs != nbytes:
            raise CollectiveError(
                f"shm: {op}: {eng.names([q])} passed {theirs} bytes for this chunk, this rank {nbytes}; every rank "
                "must call the collective with tensors of the same shape and dtype"
            )


def _chunk(eng: Rounds, element_size: int, blocks: int = 1) -> int:
    """Elements per block per round, so that ``blocks`` blocks fill at most one slot."""
    return max(1, eng.lay.slot_bytes // (element_size * blocks))


def all_reduce(eng: Rounds, work: ShmWork, flat: torch.Tensor, op: ReduceOp) -> Steps:
    """Every rank reduces every chunk whole; from ``SPLIT_BYTES`` on ``SPLIT_RANKS``: reduce-scatter + all-gather."""
    total = flat.numel() * flat.element_size()
    split = _splits(eng, flat, total)
    name = _SPLIT if split else "all_reduce"  # signed: ranks that chose different paths get a named error
    per = _chunk(eng, flat.element_size())
    for start in range(0, flat.numel(), per):
        piece = flat if per >= flat.numel() else flat[start : start + per]
        if not split:
            yield from _whole_round(eng, work, piece, op, total)
            continue
        r = yield from eng.begin_round(work, "all_reduce")
        _write(eng, r, [piece])
        sign(eng, r, name, total)
        eng.publish(r)
        yield from eng.await_arrival(work, r, eng.others, "all_reduce")
        _check_sizes(eng, r, eng.others, piece.numel() * piece.element_size(), name, total)
        yield from _reduce_slices(eng, work, r, piece, op)
        eng.finish_round(r)
    if op is ReduceOp.AVG:
        finish_avg(flat, op, eng.n)


def _splits(eng: Rounds, flat: torch.Tensor, total: int) -> bool:
    """Whether ``all_reduce`` takes the split path for ``flat`` (``SPLIT_BYTES``, ``SPLIT_RANKS``)."""
    return eng.n >= max(2, SPLIT_RANKS) and total >= SPLIT_BYTES and flat.numel() >= eng.n * _LINE


def is_small(eng: Rounds, flat: torch.Tensor) -> bool:
    """Whether ``small_all_reduce`` may take ``flat``: one whole-path round (what ``all_reduce`` would do)
    of fewer than ``SMALL_BYTES``."""
    total = flat.numel() * flat.element_size()
    return total < SMALL_BYTES and total <= eng.lay.slot_bytes and not _splits(eng, flat, total)


def _whole_round(eng: Rounds, work: ShmWork, piece: torch.Tensor, op: ReduceOp, total: int) -> Steps:
    """One round of the whole path: write ``piece``, publish, reduce every rank's slot into it in rank order
    (a wait's generator is started only when a peer is behind: ranks in step never wait)."""
    r = eng.round + 1
    if r > 2 and eng.lagging(eng.ack, r - 2):
        eng.round = r
        yield from eng.peers.wait_counters(work, eng.ack, eng.others, r - 2, "all_reduce")
    _publish_whole(eng, r, piece, total)
    if eng.lagging(eng.arrive, r):
        yield from eng.await_arrival(work, r, eng.others, "all_reduce")
    _reduce_whole(eng, r, piece, op, total)


def small_all_reduce(eng: Rounds, flat: torch.Tensor, op: ReduceOp, wait_s: float) -> Callable[[ShmWork], Steps] | None:
    """A one-round all_reduce run as a plain call, in the caller's thread (``Engine.run_now``): None once
    it is done (its peers arrived within ``wait_s`` seconds of this rank's publish: no generator, no work
    object, no queue, no wait loop), else the rest of it, to be queued as the generator of a work. Small
    tensors only (``SMALL_BYTES``: no torch intra-op threads start for them)."""
    total = flat.numel() * flat.element_size()
    r = eng.round + 1
    if r > 2 and any_below(eng.ack, eng.others, r - 2):  # this rank's slot is still being read: the general path
        return lambda work: all_reduce(eng, work, flat, op)
    _publish_whole(eng, r, flat, total)
    if any_below(eng.arrive, eng.others, r):
        until = time.perf_counter() + wait_s
        while any_below(eng.arrive, eng.others, r):
            if time.perf_counter() >= until:
                return lambda work: _finish_small(eng, work, r, flat, op, total)
    _reduce_small(eng, r, flat, op, total)
    return None


def _finish_small(eng: Rounds, work: ShmWork, r: int, flat: torch.Tensor, op: ReduceOp, total: int) -> Steps:
    """The rest of ``small_all_reduce`` when a peer had not yet arrived."""
    yield from eng.await_arrival(work, r, eng.others, "all_reduce")
    _reduce_small(eng, r, flat, op, total)


def _reduce_small(eng: Rounds, r: int, flat: torch.Tensor, op: ReduceOp, total: int) -> None:
    """The small all_reduce's one round, every peer arrived: reduce (and average)."""
    _reduce_whole(eng, r, flat, op, total)
    if op is ReduceOp.AVG:
        finish_avg(flat, op, eng.n)


#: ``small_all_reduce`` takes tensors of fewer bytes than this: fewer elements than torch's parallel grain
#: (32768, from which its ops may start intra-op threads), so they run serially without ``one_torch_thread``.
SMALL_BYTES = 32 << 10


def _publish_whole(eng: Rounds, r: int, piece: torch.Tensor, total: int) -> None:
    """Round ``r`` of the whole path: ``piece`` into this rank's slot, signed, published."""
    eng.round = r
    me, parity, count = eng.me, r & 1, piece.numel()
    eng.view(me, r, piece.dtype, 0, count).copy_(piece)
    eng.slot_size[me][parity].value = count * piece.element_size()
    eng.slot_sig[me][parity].value = (_CODES["all_reduce"] << 56) | total
    eng.publish(r)


def _reduce_whole(eng: Rounds, r: int, piece: torch.Tensor, op: ReduceOp, total: int) -> None:
    """Round ``r`` of the whole path, every peer arrived: check their slots, reduce them into ``piece``
    in rank order, ack."""
    count, dtype, parity = piece.numel(), piece.dtype, r & 1
    nbytes, sig = count * piece.element_size(), (_CODES["all_reduce"] << 56) | total
    for q in eng.others:  # (the common case inline: _check_sizes names what differs)
        if eng.slot_size[q][parity].value != nbytes or eng.slot_sig[q][parity].value != sig:
            _check_sizes(eng, r, eng.others, nbytes, "all_reduce", total)
    for q in _whole_order(eng, piece, r):
        reduce_into(piece, eng.view(q, r, dtype, 0, count), op)
    eng.finish_round(r)


def _whole_order(eng: Rounds, piece: torch.Tensor, r: int) -> list[int]:
    """The slots to reduce into ``piece`` (which holds this rank's own chunk), in rank order: ranks 0 and 1
    start from their own data (x1 op x0 is x0 op x1: the ops are commutative), saving a copy of the chunk;
    the others start from rank 0's slot, copied in."""
    n, me = eng.n, eng.me
    if me <= 1:
        return eng.others if n <= 2 else [1 - me, *range(2, n)]
    piece.copy_(_read(eng, 0, r, piece.dtype, 0, piece.numel()))
    return list(range(1, n))


def _slices(n: int, count: int, element_size: int) -> list[int]:
    """Bounds of ``n`` slices of ``count`` elements, cut at cache-line boundaries: slice q is ``[b[q], b[q+1])``."""
    line = max(1, 64 // element_size)
    return [0] + [count * q // n // line * line for q in range(1, n)] + [count]


def _reduce_slices(eng: Rounds, work: ShmWork, r: int, piece: torch.Tensor, op: ReduceOp) -> Steps:
    """Round ``r`` (every slot written): this rank reduces its slice of every slot into its own slot, the
    others' reduced slices are copied from theirs. Each slice is reduced by one rank, in rank order."""
    me, dtype, k = eng.me, piece.dtype, piece.numel()
    bounds = _slices(eng.n, k, piece.element_size())
    lo, count = bounds[me], bounds[me + 1] - bounds[me]
    mine = _read(eng, me, r, dtype, lo, count)
    if count:
        if me <= 1:  # in place: x0 op x1 (ops are commutative) op x2 ... is rank order
            for q in eng.others:
                reduce_into(mine, _read(eng, q, r, dtype, lo, count), op)
        else:  # rank order: the first rank's slice, then the others' (this rank's own included)
            acc = piece[lo : lo + count]
            acc.copy_(_read(eng, 0, r, dtype, lo, count))
            for q in range(1, eng.n):
                reduce_into(acc, _read(eng, q, r, dtype, lo, count), op)
            mine.copy_(acc)
    eng.publish_reduced(r)
    yield from eng.await_reduced(work, r, eng.others, "all_reduce")
    for q in range(eng.n):
        if q != me:
            piece[bounds[q] : bounds[q + 1]].copy_(_read(eng, q, r, dtype, bounds[q], bounds[q + 1] - bounds[q]))
        elif me <= 1:
            piece[lo : lo + count].copy_(mine)


def reduce(eng: Rounds, work: ShmWork, flat: torch.Tensor, dst: int, op: ReduceOp) -> Steps:
    total = flat.numel() * flat.element_size()
    per = _chunk(eng, flat.element_size())
    scratch = torch.empty(min(per, flat.numel()), dtype=flat.dtype) if eng.me == dst else None
    for start in range(0, flat.numel(), per):
        piece = flat[start : start + per]
        r = yield from eng.begin_round(work, "reduce")
        _write(eng, r, [piece])
        sign(eng, r, "reduce", total)
        eng.publish(r)
        if eng.me == dst:
            assert scratch is not None
            yield from eng.await_arrival(work, r, eng.others, "reduce")
            _check_sizes(eng, r, eng.others, piece.numel() * piece.element_size(), "reduce", total)
            acc = scratch[: piece.numel()]
            acc.copy_(_read(eng, 0, r, flat.dtype, 0, piece.numel()))
            for q in range(1, eng.n):
                reduce_into(acc, _read(eng, q, r, flat.dtype, 0, piece.numel()), op)
            piece.copy_(acc)
        eng.finish_round(r)
    if eng.me == dst:
        finish_avg(flat, op, eng.n)


def broadcast(eng: Rounds, work: ShmWork, flat: torch.Tensor, src: int) -> Steps:
    total = flat.numel() * flat.element_size()
    per = _chunk(eng, flat.element_size())
    for start in range(0, flat.numel(), per):
        piece = flat[start : start + per]
        r = yield from eng.begin_round(work, "broadcast")
        if eng.me == src:
            _write(eng, r, [piece])
            sign(eng, r, "broadcast", total)
        eng.publish(r)
        if eng.me != src:
            yield from eng.await_arrival(work, r, [src], "broadcast")
            _check_sizes(eng, r, [src], piece.numel() * piece.element_size(), "broadcast", total)
            piece.copy_(_read(eng, src, r, flat.dtype, 0, piece.numel()))
        eng.finish_round(r)


def all_gather(eng: Rounds, work: ShmWork, out: torch.Tensor, inp: torch.Tensor) -> Steps:
    yield from _gather_into(eng, work, out, inp, "all_gather_into_tensor", None)


def gather(eng: Rounds, work: ShmWork, out: torch.Tensor | None, inp: torch.Tensor, dst: int) -> Steps:
    yield from _gather_into(eng, work, out, inp, "gather", dst)


def _gather_into(eng: Rounds, work: ShmWork, out: torch.Tensor | None, inp: torch.Tensor, name: str, dst: int | None) -> Steps:
    """Every rank's ``inp`` into ``out`` in rank order, chunk by chunk: on every rank, or on ``dst`` only."""
    total = inp.numel() * inp.element_size()
    m, per = inp.numel(), _chunk(eng, inp.element_size())
    for start in range(0, m, per):
        piece = inp[start : start + per]
        k = piece.numel()
        r = yield from eng.begin_round(work, name)
        _write(eng, r, [piece])
        sign(eng, r, name, total)
        eng.publish(r)
        if dst is None or eng.me == dst:
            assert out is not None
            yield from eng.await_arrival(work, r, eng.others, name)
            _check_sizes(eng, r, eng.others, k * piece.element_size(), name, total)
            for q in range(eng.n):
                out[q * m + start : q * m + start + k].copy_(_read(eng, q, r, inp.dtype, 0, k))
        eng.finish_round(r)


def reduce_scatter(eng: Rounds, work: ShmWork, out: torch.Tensor, inp: torch.Tensor, op: ReduceOp) -> Steps:
    total = out.numel() * out.element_size()
    n, m = eng.n, out.numel()
    per = _chunk(eng, out.element_size(), n)
    for start in range(0, m, per):
        k = min(per, m - start)
        r = yield from eng.begin_round(work, "reduce_scatter_tensor")
        _write(eng, r, [inp[i * m + start : i * m + start + k] for i in range(n)])
        sign(eng, r, "reduce_scatter_tensor", total)
        eng.publish(r)
        yield from eng.await_arrival(work, r, eng.others, "reduce_scatter_tensor")
        _check_sizes(eng, r, eng.others, n * k * out.element_size(), "reduce_scatter_tensor", total)
        piece = out[start : start + k]
        piece.copy_(_read(eng, 0, r, out.dtype, eng.me * k, k))
        for q in range(1, n):
            reduce_into(piece, _read(eng, q, r, out.dtype, eng.me * k, k), op)
        eng.finish_round(r)
    finish_avg(out, op, n)


def scatter(eng: Rounds, work: ShmWork, out: torch.Tensor, inp: torch.Tensor | None, src: int) -> Steps:
    total = out.numel() * out.element_size()
    n, m = eng.n, out.numel()
    per = _chunk(eng, out.element_size(), n)
    for start in range(0, m, per):
        k = min(per, m - start)
        r = yield from eng.begin_round(work, "scatter")
        if eng.me == src:
            assert inp is not None
            _write(eng, r, [inp[i * m + start : i * m + start + k] for i in range(n)])
            sign(eng, r, "scatter", total)
        eng.publish(r)
        if eng.me != src:
            yield from eng.await_arrival(work, r, [src], "scatter")
            _check_sizes(eng, r, [src], n * k * out.element_size(), "scatter", total)
        out[start : start + k].copy_(_read(eng, src, r, out.dtype, eng.me * k, k))
        eng.finish_round(r)


def barrier(eng: Rounds, work: ShmWork) -> Steps:
    r = yield from eng.begin_round(work, "barrier")
    eng.slot_size[eng.me][r & 1].value = 0
    sign(eng, r, "barrier", 0)
    eng.publish(r)
    yield from eng.await_arrival(work, r, eng.others, "barrier")
    _check_sizes(eng, r, eng.others, 0, "barrier", 0)
    eng.finish_round(r)
