"""The public action IR of pipeline schedules: ``Action(stage, microbatch, kind)``, pure data."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


class Kind(str, enum.Enum):
    """What one step of a rank's program does.

    F, B, W compute (forward, input-gradient backward, weight-gradient backward);
    the rest move tensors between ranks. ``SEND_F(s, mb)`` pairs with
    ``RECV_F(s + 1, mb)`` and ``SEND_B(s, mb)`` with ``RECV_B(s - 1, mb)``.
    """

    F = "F"
    B = "B"
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    def __str__(self) -> str:
        return self.value


COMPUTE = frozenset({Kind.F, Kind.B, Kind.W})
SENDS = frozenset({Kind.SEND_F, Kind.SEND_B})
RECVS = frozenset({Kind.RECV_F, Kind.RECV_B})


@dataclass(frozen=True)
class Action:
    """One step of a rank's program: ``Action(stage=1, microbatch=3, kind="F")``.

    ``kind`` may be given as a str; it is stored as a ``Kind`` (a str Enum, so
    ``action.kind == "F"`` holds). ``str(action)`` is short: ``F1.3`` (kind,
    stage, microbatch).
    """

    stage: int
    microbatch: int
    kind: Kind

    def __post_init__(self) -> None:
        if not isinstance(self.kind, Kind):
            try:
                object.__setattr__(self, "kind", Kind(self.kind))
            except ValueError:
                names = ", ".join(k.value for k in Kind)
                raise ValueError(f"Action kind {self.kind!r} is unknown; kinds are {names}") from None

    def __str__(self) -> str:
        return f"{self.kind.value}{self.stage}.{self.microbatch}"

    def describe(self) -> str:
        """``RECV_F of stage 2, microbatch 3``: for error messages and the flight recorder."""
        return f"{self.kind.value} of stage {self.stage}, microbatch {self.microbatch}"

    def peer(self) -> Action | None:
        """The action on another rank this one pairs with (None for compute)."""
        match self.kind:
            case Kind.SEND_F:
                return Action(self.stage + 1, self.microbatch, Kind.RECV_F)
            case Kind.RECV_F:
                return Action(self.stage - 1, self.microbatch, Kind.SEND_F)
            case Kind.SEND_B:
                return Action(self.stage - 1, self.microbatch, Kind.RECV_B)
            case Kind.RECV_B:
                return Action(self.stage + 1, self.microbatch, Kind.SEND_B)
        return None


#: A schedule's output: one program (list of actions) per rank.
Programs = Mapping[int, Sequence[Action]]


def stage_rank(stage: int, world: int) -> int:
    """The rank that holds ``stage``: stage s lives on rank s % world (the fixed contract)."""
    return stage % world


def with_communication(compute: Mapping[int, Sequence[Action]], num_stages: int) -> dict[int, list[Action]]:
    """Add the sends and receives that compute-only programs need.

    A RECV goes right before the F or B that consumes it, a SEND right after
    the F or B that produces it; transfers between stages of one rank need
    none. Schedule authors usually write only the compute order and call this.
    """
    world = len(compute)
    programs: dict[int, list[Action]] = {}
    for rank, actions in compute.items():
        out: list[Action] = []
        for a in actions:
            s, mb = a.stage, a.microbatch
            if a.kind == Kind.F and s > 0 and stage_rank(s - 1, world) != rank:
                out.append(Action(s, mb, Kind.RECV_F))
            if a.kind == Kind.B and s < num_stages - 1 and stage_rank(s + 1, world) != rank:
                out.append(Action(s, mb, Kind.RECV_B))
            out.append(a)
            if a.kind == Kind.F and s < num_stages - 1 and stage_rank(s + 1, world) != rank:
                out.append(Action(s, mb, Kind.SEND_F))
            if a.kind == Kind.B and s > 0 and stage_rank(s - 1, world) != rank:
                out.append(Action(s, mb, Kind.SEND_B))
        programs[rank] = out
    return programs


def format_program(program: Sequence[Action]) -> str:
    """A program as one line: ``F0.0 SEND_F0.0 F0.1 ...``."""
    return " ".join(map(str, program))
