"""What the ranks of a group must agree on for a call: its signature, read from a flight-recorder Entry.

Pure functions over Entries and signature strings, shared by the live checks
(``spmd.comm.health``: desync, first calls, the always-on history check, the
diagnosis of a stuck op) and the offline analysis of dumps (``spmd.debug.analyze``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from spmd.debug.recorder import Entry

#: Ops whose ranks may legitimately pass different shapes: only op and dtype must agree (and for
#: all_to_all_single the shape of a row: its rows travel between ranks, their number may differ).
SHAPES_MAY_DIFFER = {"all_to_all_single", "barrier"}


def call_signature(entry: Entry, root: int | None = None) -> str:
    """What every rank of the group must agree on for ``entry``'s op (shapes only where they must match;
    all_to_all_single's splits follow as `` splits 1,2/3,4``, to be matched across ranks by ``pair_split_mismatch``)."""
    if entry.op in SHAPES_MAY_DIFFER:
        dtypes = ",".join(str(d).removeprefix("torch.") for d in entry.dtypes)
        row = entry.shapes[0][1:] if entry.op == "all_to_all_single" else ()
        text = f"{entry.op}({dtypes}; rows {'x'.join(map(str, row))})" if row else f"{entry.op}({dtypes})"
    else:
        text = entry.signature()
    text += f" root={root}" if root is not None else ""
    if entry.splits is not None:
        text += f" splits {','.join(map(str, entry.splits[0]))}/{','.join(map(str, entry.splits[1]))}"
    return text


def comparable_signature(entry: Entry) -> str:
    """``call_signature`` without all_to_all_single's splits: what every member's call must share, for
    the diagnosis of a stuck op (splits differ by rank; ``pair_split_mismatch`` checks that they pair up)."""
    return call_signature(entry).partition(" splits ")[0]


def _parse_splits(call: str) -> tuple[list[int], list[int]]:
    """(rows sent to each rank, rows received from each rank) from a signature's `` splits a,b/c,d``."""
    _, _, splits = call.partition(" splits ")
    send_text, _, receive_text = splits.partition("/")
    return [int(n) for n in send_text.split(",") if n], [int(n) for n in receive_text.split(",") if n]


def pair_split_mismatch(mine: str, i: int, theirs: str, j: int, ranks: Sequence[int]) -> str | None:
    """Whether all_to_all_single's splits of group ranks ``i`` and ``j`` disagree with each other, described."""
    (my_sends, my_receives), (their_sends, their_receives) = _parse_splits(mine), _parse_splits(theirs)
    if j < len(my_sends) and i < len(their_receives) and my_sends[j] != their_receives[i]:
        return f"rank {ranks[i]} sends {my_sends[j]} rows to rank {ranks[j]}, which expects {their_receives[i]} from it"
    if i < len(their_sends) and j < len(my_receives) and their_sends[i] != my_receives[j]:
        return f"rank {ranks[j]} sends {their_sends[i]} rows to rank {ranks[i]}, which expects {my_receives[j]} from it"
    return None


def split_mismatch(calls: list[str], ranks: tuple[int, ...]) -> str | None:
    """For all_to_all_single: the first pair of ranks whose splits disagree, described; else None.

    Rank i's input split j (rows it sends to j) must equal rank j's output split i.
    """
    parsed = [_parse_splits(call) for call in calls]
    sends = [p[0] for p in parsed]
    receives = [p[1] for p in parsed]
    for i, sent in enumerate(sends):
        for j, rows in enumerate(sent):
            if j < len(receives) and i < len(receives[j]) and receives[j][i] != rows:
                return f"rank {ranks[i]} sends {rows} rows to rank {ranks[j]}, which expects {receives[j][i]} from it"
    return None


def disagreement(seq: int, group_name: str, detail: str) -> str:
    """The reason a group is given up for when its ranks' calls at ``seq`` disagree (``disagreed_seq`` reads the
    number back, also out of the reason another rank announced)."""
    return f"ranks disagree on collective #{seq} of group {group_name!r}{detail}"


_DISAGREEMENT = re.compile(r"ranks disagree on collective #(\d+) of group ")


def disagreed_seq(reason: str) -> int | None:
    """The sequence number of the call a ``disagreement`` reason names, else None."""
    found = _DISAGREEMENT.search(reason)
    return None if found is None else int(found.group(1))
