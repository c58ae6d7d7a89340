"""The runtime's transfers, worked out once per schedule: peers, tags, labels, and the metadata message format."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from spmd.comm.p2p import _check_tag
from spmd.pipeline.actions import RECVS, SENDS, Action, Kind

#: dtypes a metadata message can name (index = code).
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
_MAX_DIMS = 8
META_TAG = 1 << 23  # tags below are data, from here up metadata


def encode(t: torch.Tensor) -> torch.Tensor:
    """The metadata message of an activation: dtype code, number of dims, the dims."""
    if t.dim() > _MAX_DIMS or t.dtype not in _DTYPES:
        raise TypeError(f"pipeline: cannot send an activation of dtype {t.dtype} with {t.dim()} dims")
    meta = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64)
    meta[0], meta[1] = _DTYPES.index(t.dtype), t.dim()
    meta[2 : 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return meta


def meta_buffer() -> torch.Tensor:
    """A buffer for one metadata message."""
    return torch.empty(2 + _MAX_DIMS, dtype=torch.int64)


def decode(meta: torch.Tensor) -> tuple[torch.Size, torch.dtype]:
    """Shape and dtype from a metadata message."""
    values = meta.tolist()
    return torch.Size(values[2 : 2 + values[1]]), _DTYPES[values[0]]


class Transfer:
    """One SEND/RECV action with what posting it needs, computed once (not per step)."""

    __slots__ = ("action", "kind", "key", "pending", "peer", "tag", "meta_tag", "label", "meta_label")

    def __init__(self, a: Action, m: int, world: int) -> None:
        self.action, self.kind = a, a.kind
        s, mb = a.stage, a.microbatch
        self.key = (s, mb)  # the runtime's key of the activation (or gradient) this moves
        self.pending = (a.kind, s, mb)  # a posted receive's key
        forward = a.kind in (Kind.SEND_F, Kind.RECV_F)
        # the peer's stage; data tags are unique per (lower stage of the pair, microbatch, direction), so order never matters
        other = s + 1 if a.kind in (Kind.SEND_F, Kind.RECV_B) else s - 1
        self.peer = other % world
        lower = min(s, other)
        self.tag = 2 * (lower * m + mb) + int(not forward)
        self.meta_tag = META_TAG + lower * m + mb  # (only forward activations carry metadata)
        if self.tag >= META_TAG:  # a data tag among the metadata ones: a message could be taken for another
            raise ValueError(
                f"pipeline schedule: {a.describe()} needs data tag {self.tag}, but data tags must stay below "
                f"{META_TAG} (2 x stages x microbatches); use fewer microbatches per step or fewer stages"
            )
        _check_tag(self.tag, "isend" if a.kind in SENDS else "irecv")
        if forward:
            _check_tag(self.meta_tag, "isend" if a.kind in SENDS else "irecv")
        # p2p_context labels: a hang reads "rank 1 waits in RECV_F of stage 2, microbatch 3, from rank 0"
        self.label = a.describe()
        self.meta_label = f"{self.label} (shape metadata)"


class Batch:
    """A run of consecutive SEND/RECV actions, posted together, and the receive to prefetch after it."""

    __slots__ = ("start", "sends", "recvs", "prefetch")

    def __init__(self, start: int, transfers: Sequence[Transfer], prefetch: Transfer | None) -> None:
        self.start = start
        self.sends = [t for t in transfers if t.kind in SENDS]
        self.recvs = [t for t in transfers if t.kind in RECVS]
        self.prefetch = prefetch


def batches(program: Sequence[Action], m: int, world: int) -> dict[int, tuple[Batch, int]]:
    """For each program index that starts a run of transfers: its Batch and the index after the run."""
    transfers = {i: Transfer(a, m, world) for i, a in enumerate(program) if a.kind in SENDS or a.kind in RECVS}
    out: dict[int, tuple[Batch, int]] = {}
    i = 0
    while i < len(program):
        if i not in transfers:
            i += 1
            continue
        j = i
        while j in transfers:
            j += 1
        # the program's next receive after the run: posted early if its buffer's shape is known by then
        following = next((transfers[k] for k in range(j, len(program)) if k in transfers and program[k].kind in RECVS), None)
        out[i] = (Batch(i, [transfers[k] for k in range(i, j)], following), j)
        i = j
    return out
