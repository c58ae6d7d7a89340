"""all_to_all_single through the rank slots: each rank's rows for every peer in its slot, each reads its own.

A rank's slot is a table (what it sends to, and expects from, every rank, in bytes) and one region
per destination. In round k every rank copies the k-th slot-sized share of each of its blocks into
that block's region and publishes; every rank then copies the share meant for it out of every
peer's slot. The first round's tables tell every rank how many rounds the largest block needs, and
whether every pair of ranks agrees on its splits (if not, every rank raises the same named error).
A rank's block for itself is copied directly.
"""

from __future__ import annotations

import functools
import struct

import torch

from spmd.errors import CollectiveError
from spmd_shm.collectives import check_op, sign
from spmd_shm.peers import Steps
from spmd_shm.rounds import Rounds
from spmd_shm.work import ShmWork

_OP = "all_to_all_single"


def table_bytes(n: int) -> int:
    """Bytes of a slot's split table for ``n`` ranks (rounded up to a cache line)."""
    return (16 * n + 63) // 64 * 64


def region_bytes(slot_bytes: int, n: int) -> int:
    """Bytes of each destination's region in a slot of ``slot_bytes`` (cache-line aligned where it can be)."""
    per = (slot_bytes - table_bytes(n)) // n
    return per // 64 * 64 if per >= 64 else per


@functools.lru_cache(maxsize=64)
def _table_struct(n: int) -> struct.Struct:
    """A split table: what a rank sends to, then expects from, each of ``n`` ranks (int64 bytes)."""
    return struct.Struct(f"<{2 * n}q")


def _offsets(sizes: list[int]) -> list[int]:
    out, at = [], 0
    for size in sizes:
        out.append(at)
        at += size
    return out


def _disagreement(eng: Rounds, tables: list[tuple[int, ...]]) -> str | None:
    """The first pair of ranks whose splits disagree (q sends j other than j expects from q), or None."""
    n = eng.n
    for q in range(n):
        for j in range(n):
            sends, expects = tables[q][j], tables[j][n + q]
            if sends != expects:
                return (
                    f"shm: all_to_all_single splits disagree: {eng.names([q])} sends {sends} bytes to {eng.names([j])}, "
                    f"which expects {expects} bytes from it; every rank's output split for a peer must equal that "
                    "peer's input split for it (in rows of the same shape and dtype)"
                )
    return None


def all_to_all_single(eng: Rounds, work: ShmWork, out: torch.Tensor, inp: torch.Tensor, out_bytes: list[int], in_bytes: list[int]) -> Steps:
    """``inp`` (bytes) holds this rank's block for rank j at ``in_bytes`` offsets; ``out`` gets rank q's
    block for this rank at ``out_bytes`` offsets."""
    n, me = eng.n, eng.me
    in_at, out_at = _offsets(in_bytes), _offsets(out_bytes)
    head, per = table_bytes(n), region_bytes(eng.lay.slot_bytes, n)
    mine = sum(in_bytes)
    table = _table_struct(n)
    rounds, k = 1, 0
    while k < rounds:
        r = yield from eng.begin_round(work, _OP)
        if k == 0:
            table.pack_into(eng.mm, eng.slot_data[me][r & 1], *in_bytes, *out_bytes)
        written = 0
        for j in eng.others:
            length = min(per, max(0, in_bytes[j] - k * per))
            if length:
                eng.view(me, r, torch.uint8, head + j * per, length).copy_(inp[in_at[j] + k * per : in_at[j] + k * per + length])
            written += length
        eng.slot_size[me][r & 1].value = written
        sign(eng, r, _OP, mine)
        eng.publish(r)
        yield from eng.await_arrival(work, r, eng.others, _OP)
        check_op(eng, r, eng.others, _OP, mine, same_total=False)
        if k == 0:
            tables = [table.unpack_from(eng.mm, eng.slot_data[q][r & 1]) for q in range(n)]
            problem = _disagreement(eng, tables)
            if problem:
                raise CollectiveError(problem)
            largest = max((tables[q][j] for q in range(n) for j in range(n) if q != j), default=0)
            rounds = max(1, -(-largest // per))
            if in_bytes[me]:
                out[out_at[me] : out_at[me] + in_bytes[me]].copy_(inp[in_at[me] : in_at[me] + in_bytes[me]])
        for q in eng.others:
            length = min(per, max(0, out_bytes[q] - k * per))
            if length:
                out[out_at[q] + k * per : out_at[q] + k * per + length].copy_(eng.view(q, r, torch.uint8, head + me * per, length))
        eng.finish_round(r)
        k += 1
