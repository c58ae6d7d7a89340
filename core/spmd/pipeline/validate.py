"""``validate(programs)``: prove a set of per-rank programs runs to the end, before anything runs.

The model is the runtime's, made stricter: each rank runs its actions in
order, a send never blocks, a receive blocks until its peer has sent. A
program that passes cannot hang in the runtime, which posts sends even
earlier and waits for receives even later. ``validated_programs`` runs a
schedule class's programs through it, once per arguments.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

from spmd.errors import SpmdError
from spmd.pipeline.actions import COMPUTE, RECVS, SENDS, Action, Kind, stage_rank


class ScheduleError(SpmdError, ValueError):
    """A pipeline program that would hang, lose or duplicate a microbatch; the message names rank, step, action."""


def _where(rank: int, step: int, action: Action) -> str:
    return f"rank {rank}, step {step}: {action} ({action.describe()})"


def _check_local(rank: int, program: Sequence[Action], world: int, num_stages: int) -> None:
    """Per-rank rules: placement, order of F/B/W, inputs present, no duplicates."""
    done: set[tuple[Kind, int, int]] = set()
    for step, a in enumerate(program):
        where = _where(rank, step, a)
        if not 0 <= a.stage < num_stages:
            raise ScheduleError(f"{where}: stage {a.stage} is outside 0..{num_stages - 1}")
        if stage_rank(a.stage, world) != rank:
            raise ScheduleError(f"{where}: stage {a.stage} lives on rank {stage_rank(a.stage, world)} (stage s on rank s % {world})")
        if a.microbatch < 0:
            raise ScheduleError(f"{where}: negative microbatch")
        key = (a.kind, a.stage, a.microbatch)
        if key in done:
            raise ScheduleError(f"{where}: duplicated; microbatch {a.microbatch} already had {a.kind} on stage {a.stage}")
        s, mb = a.stage, a.microbatch
        need: list[tuple[Kind, int, int]] = []
        if a.kind == Kind.F and s > 0:
            need.append((Kind.RECV_F, s, mb) if stage_rank(s - 1, world) != rank else (Kind.F, s - 1, mb))
        elif a.kind == Kind.B:
            need.append((Kind.F, s, mb))
            if s < num_stages - 1:
                need.append((Kind.RECV_B, s, mb) if stage_rank(s + 1, world) != rank else (Kind.B, s + 1, mb))
        elif a.kind == Kind.W:
            need.append((Kind.B, s, mb))
        elif a.kind == Kind.SEND_F:
            need.append((Kind.F, s, mb))
        elif a.kind == Kind.SEND_B:
            need.append((Kind.B, s, mb))
        if a.kind in SENDS or a.kind in RECVS:
            peer = a.peer()
            assert peer is not None
            if not 0 <= peer.stage < num_stages:
                raise ScheduleError(f"{where}: there is no stage {peer.stage} to pair with ({peer})")
            if stage_rank(peer.stage, world) == rank:
                raise ScheduleError(f"{where}: stages {s} and {peer.stage} share rank {rank}; drop the transfer")
        for kind, ns, nmb in need:
            if (kind, ns, nmb) not in done:
                missing = Action(ns, nmb, kind)
                raise ScheduleError(f"{where}: needs {missing} ({missing.describe()}) earlier on rank {rank}, and it has not run")
        done.add(key)
    for s in range(rank, num_stages, world):
        fs = {mb for k, st, mb in done if k == Kind.F and st == s}
        bs = {mb for k, st, mb in done if k == Kind.B and st == s}
        if fs != bs:
            lost = sorted(fs ^ bs)
            raise ScheduleError(f"rank {rank}: stage {s} runs F and B for different microbatches (unmatched: {lost})")


def validate(programs: Mapping[int, Sequence[Action]], *, n_microbatches: int | None = None, num_stages: int | None = None) -> None:
    """Raise ScheduleError unless every rank's program runs to completion with every microbatch once.

    Checks, in this order: each action's stage lives on its rank; no action
    is duplicated; F comes before B, B before W, each input was received or
    computed before it is used; every stage runs F and B for microbatches
    0..M-1; then simulates the send/receive matching of all ranks together
    and names every rank that would wait forever (deadlock, missing send),
    every send nobody receives, and receives posted in another order than
    their sends between a pair of ranks. Costs O(total actions).

    >>> validate(get_schedule("1f1b").programs(4, 1, 8))
    """
    world = len(programs)
    if sorted(programs) != list(range(world)):
        raise ScheduleError(f"programs must be keyed by ranks 0..{world - 1}; got {sorted(programs)}")
    if num_stages is None:
        num_stages = 1 + max((a.stage for p in programs.values() for a in p), default=-1)
    for rank in range(world):
        _check_local(rank, programs[rank], world, num_stages)
    if n_microbatches is None:
        n_microbatches = 1 + max((a.microbatch for p in programs.values() for a in p), default=-1)
    expected = set(range(n_microbatches))
    for s in range(num_stages):
        r = stage_rank(s, world)
        got = {a.microbatch for a in programs[r] if a.stage == s and a.kind == Kind.F}
        if got != expected:
            missing, extra = sorted(expected - got), sorted(got - expected)
            raise ScheduleError(
                f"rank {r}: stage {s} drops microbatches {missing}" if missing else f"rank {r}: stage {s} runs unknown microbatches {extra}"
            )
    _check_matching(programs, world)


def _check_matching(programs: Mapping[int, Sequence[Action]], world: int) -> None:
    """Run all programs together: sends never block, receives wait for their send."""
    pc = [0] * world
    sent: dict[Action, int] = {}  # send action -> step on its rank
    received: set[Action] = set()
    progress = True
    while progress:
        progress = False
        for rank in range(world):
            program = programs[rank]
            while pc[rank] < len(program):
                a = program[pc[rank]]
                if a.kind in RECVS:
                    send = a.peer()
                    assert send is not None
                    if send not in sent:
                        break
                    received.add(send)
                elif a.kind in SENDS:
                    sent[a] = pc[rank]
                pc[rank] += 1
                progress = True
    stuck = [r for r in range(world) if pc[r] < len(programs[r])]
    if stuck:
        lines = []
        for r in stuck:
            a = programs[r][pc[r]]
            send = a.peer()
            assert send is not None
            src = stage_rank(send.stage, world)
            if send not in programs[src]:
                why = f"rank {src} never runs {send}: a missing send"
            elif pc[src] < len(programs[src]):
                why = f"rank {src} would send it later, but itself waits at step {pc[src]} ({programs[src][pc[src]]})"
            else:
                why = f"rank {src} finished without sending it"
            lines.append(f"{_where(r, pc[r], a)} waits forever for {send} from rank {src}; {why}")
        raise ScheduleError("the programs would hang (deadlock):\n  " + "\n  ".join(lines))
    for send, step in sent.items():
        if send not in received:
            rank = stage_rank(send.stage, world)
            recv = send.peer()
            assert recv is not None
            raise ScheduleError(
                f"{_where(rank, step, send)} is never received: rank {stage_rank(recv.stage, world)} has no {recv}"
            )
    _check_pair_order(programs, world)


def _check_pair_order(programs: Mapping[int, Sequence[Action]], world: int) -> None:
    """Between each pair of ranks the receives come in the order of the sends.

    spmd's runtime tags every transfer, but a backend that matches
    point-to-point messages by their order between two ranks, not by tag
    (NCCL), would hand one microbatch's tensor to another's receive: of the
    same shape, so nothing would fail and the loss would pair wrong inputs
    with targets.
    """
    sends: dict[tuple[int, int], list[Action]] = {}
    recvs: dict[tuple[int, int], list[Action]] = {}
    for rank in range(world):
        for a in programs[rank]:
            peer = a.peer() if a.kind in SENDS or a.kind in RECVS else None
            if peer is None:
                continue
            if a.kind in SENDS:
                sends.setdefault((rank, stage_rank(peer.stage, world)), []).append(a)
            else:
                recvs.setdefault((stage_rank(peer.stage, world), rank), []).append(peer)
    for (src, dst), order in sorted(sends.items()):
        got = recvs.get((src, dst), [])
        for sent_action, awaited in zip(order, got):
            if sent_action != awaited:
                raise ScheduleError(
                    f"rank {src} sends {sent_action} to rank {dst} where rank {dst} receives the message of {awaited}: "
                    "a backend that matches messages between two ranks by order, not tag (NCCL), would hand one "
                    f"microbatch's tensor to another; make rank {dst} receive in the order rank {src} sends"
                )


__all__ = ["COMPUTE", "ScheduleError", "validate"]


@functools.lru_cache(maxsize=256)
def validated_programs(cls: type, num_stages: int, stages_per_rank: int, n_microbatches: int) -> dict[int, tuple[Action, ...]]:
    """``cls.programs(...)``, validated once per arguments (a buggy schedule fails here, never as a hang)."""
    programs = cls.programs(num_stages, stages_per_rank, n_microbatches)  # type: ignore[attr-defined]
    try:
        validate(programs, n_microbatches=n_microbatches, num_stages=num_stages)
    except ScheduleError as error:
        raise ScheduleError(
            f"schedule {getattr(cls, 'name', cls.__qualname__)!r} ({cls.__module__}.{cls.__qualname__}) made an invalid program "
            f"for {num_stages} stages, {stages_per_rank} per rank, {n_microbatches} microbatches: {error}"
        ) from error
    world = num_stages // stages_per_rank
    if sorted(programs) != list(range(world)):
        raise ScheduleError(f"schedule {cls.__qualname__} returned programs for ranks {sorted(programs)}; expected 0..{world - 1}")
    return {r: tuple(p) for r, p in programs.items()}
