"""Uneven inputs for DDP: ranks that ran out of data shadow the others' collectives (torch's ``join``).

Inside ``ddp.join()``, every forward of a rank that still has data first
all-reduces one small vector in which each rank marks its own slot: active
(and whether this iteration's backward syncs gradients) or joined. A rank
whose loop ended is joined: on leaving the context it keeps answering those
all-reduces, and for each iteration the active ranks run it issues the same
collectives they do (buffer broadcast, the used-parameter map, every
gradient bucket) with zeros, so nobody waits for it. When a round finds no
rank active, every rank leaves, and all take the parameters and buffers of
the authoritative rank: the highest-ranked one among the last still active.

Gradients are divided by the group size (``divide_by_initial_world_size=True``,
torch's default: joined ranks count as zeros) or by the number of active
ranks. Buffers are broadcast from the authoritative rank instead of rank 0,
which may have joined already.
"""

from __future__ import annotations

import torch

from spmd.comm.collectives import all_reduce
from spmd.comm.group import ProcessGroup
from spmd.errors import SpmdError
from spmd.parallel.reducer import Reducer
from spmd.parallel.sync import broadcast_coalesced

#: A rank's slot in a round: 0 joined; ACTIVE, plus SYNC when this iteration's backward syncs.
ACTIVE, SYNC = 2, 1


class Join:
    """The state of one ``DistributedDataParallel.join()`` context on this rank."""

    def __init__(self, group: ProcessGroup, reducer: Reducer, module: torch.nn.Module, broadcast_buffers: bool,
                 divide_by_initial_world_size: bool, throw_on_early_termination: bool) -> None:
        self.group = group
        #: The DDP model's parts that a joined rank keeps in step: its reducer and its module's buffers.
        self.reducer = reducer
        self.module = module
        self.broadcast_buffers = broadcast_buffers
        self.divide_by_initial_world_size = divide_by_initial_world_size
        self.throw_on_early_termination = throw_on_early_termination
        #: Group rank whose state counts: the highest active rank of the last round with any.
        self.authority = self.group.size - 1

    def _round(self, sync: bool | None) -> tuple[list[int], bool]:
        """One agreement: returns the active group ranks and whether their backward syncs.

        ``sync`` is None on a joined rank. The last slot counts joined ranks.
        """
        g = self.group
        slots = torch.zeros(g.size + 1, dtype=torch.int64)
        if sync is None:
            slots[g.size] = 1
        else:
            slots[g.rank] = ACTIVE + (SYNC if sync else 0)
        all_reduce(slots, group=g)
        codes = slots.tolist()
        active = [r for r in range(g.size) if codes[r]]
        if active and codes[g.size] and self.throw_on_early_termination:
            raise SpmdError(
                f"DistributedDataParallel.join(throw_on_early_termination=True): group rank(s) "
                f"{[r for r in range(g.size) if not codes[r]]} of group {g.name!r} ran out of inputs "
                "while others still had some; every rank raises here"
            )
        if active:
            self.authority = active[-1]
        return active, bool(active) and bool(codes[active[-1]] & SYNC)

    # -- a rank with data: once per forward ------------------------------------------------
    def before_forward(self, sync: bool) -> int:
        """Announce this iteration; returns the group rank to broadcast buffers from."""
        active, _ = self._round(sync)
        reducer = self.reducer
        reducer.divisor = self.group.size if self.divide_by_initial_world_size else len(active)
        return self.authority

    # -- a rank without data: until every rank is out ----------------------------------------
    def shadow_until_all_joined(self) -> None:
        """Match the active ranks' collectives with zeros until none is left, then take the final state."""
        while True:
            active, sync = self._round(None)
            if not active:
                break
            if self.broadcast_buffers:
                buffers = list(self.module.buffers())
                if buffers:
                    broadcast_coalesced(buffers, self.group, src=self.authority)
            if sync:
                self.reducer.shadow_backward()
        self.reducer.divisor = None
        state = [p.detach() for p in self.module.parameters()] + list(self.module.buffers())
        broadcast_coalesced(state, self.group, src=self.authority)
