"""The builtin schedules plugin: ``gpipe``, ``1f1b``, ``interleaved_1f1b`` and ``zb_h1`` (program generators only)."""

from __future__ import annotations

from spmd.markers import hookimpl
from spmd.pipeline.actions import Action, Kind, with_communication
from spmd.pipeline.schedule import Schedule


def _world(num_stages: int, stages_per_rank: int, name: str) -> int:
    if stages_per_rank < 1 or num_stages % stages_per_rank:
        raise ValueError(f"{name}: {num_stages} stages do not split into {stages_per_rank} per rank")
    return num_stages // stages_per_rank


def _one_per_rank(name: str, num_stages: int, stages_per_rank: int) -> int:
    if stages_per_rank != 1:
        raise ValueError(f"{name} runs one stage per rank (got {stages_per_rank}); use interleaved_1f1b for several")
    return num_stages


class GPipe(Schedule):
    """All forwards, then all backwards: simple, M microbatches' activations live at once."""

    name = "gpipe"

    @classmethod
    def programs(cls, num_stages: int, stages_per_rank: int, n_microbatches: int) -> dict[int, list[Action]]:
        world = _one_per_rank(cls.name, num_stages, stages_per_rank)
        compute = {
            r: [Action(r, m, Kind.F) for m in range(n_microbatches)] + [Action(r, m, Kind.B) for m in range(n_microbatches)]
            for r in range(world)
        }
        return with_communication(compute, num_stages)


def _one_f_one_b(rank: int, world: int, m: int) -> list[tuple[Kind, int]]:
    """The 1F1B order of rank ``rank``: P - rank - 1 warm-up forwards, then alternate, then drain."""
    warmup = min(world - rank - 1, m)
    order: list[tuple[Kind, int]] = [(Kind.F, i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [(Kind.F, warmup + i), (Kind.B, i)]
    order += [(Kind.B, i) for i in range(m - warmup, m)]
    return order


class OneFOneB(Schedule):
    """One forward, one backward: GPipe's bubble with at most P microbatches live (PipeDream-Flush)."""

    name = "1f1b"

    @classmethod
    def programs(cls, num_stages: int, stages_per_rank: int, n_microbatches: int) -> dict[int, list[Action]]:
        world = _one_per_rank(cls.name, num_stages, stages_per_rank)
        compute = {r: [Action(r, mb, k) for k, mb in _one_f_one_b(r, world, n_microbatches)] for r in range(world)}
        return with_communication(compute, num_stages)


class Interleaved1F1B(Schedule):
    """Megatron's interleaved 1F1B: v stages per rank cut the bubble by v; needs M divisible by the ranks."""

    name = "interleaved_1f1b"
    stages_per_rank = 2

    @classmethod
    def programs(cls, num_stages: int, stages_per_rank: int, n_microbatches: int) -> dict[int, list[Action]]:
        world = _world(num_stages, stages_per_rank, cls.name)
        v, m = stages_per_rank, n_microbatches
        if m % world:
            raise ValueError(f"{cls.name}: {m} microbatches must be a multiple of the {world} ranks")
        total = v * m

        def unit(k: int, backward: bool, rank: int) -> Action:
            chunk = (k // world) % v
            if backward:
                chunk = v - 1 - chunk
            mb = (k // (world * v)) * world + k % world
            return Action(chunk * world + rank, mb, Kind.B if backward else Kind.F)

        compute: dict[int, list[Action]] = {}
        for r in range(world):
            warmup = min((world - r - 1) * 2 + (v - 1) * world, total) if v > 1 else min(world - r - 1, total)
            order = [unit(k, False, r) for k in range(warmup)]
            for k in range(total - warmup):
                order += [unit(warmup + k, False, r), unit(k, True, r)]
            order += [unit(k, True, r) for k in range(total - warmup, total)]
            compute[r] = order
        return with_communication(compute, num_stages)


class ZeroBubbleH1(Schedule):
    """ZB-H1 (Qi et al., 2023): 1F1B with backward split into B (input gradient) and W (weight gradient).

    B stays on the critical path and W fills idle time: in the steady phase
    rank r keeps up to r weight steps pending (the later ranks wait longest
    for their first forward, so they can afford it), and after its last
    forward it runs each W right behind its B. Peak live activations stay at
    P (activations live until W). With F = B = W = 1 on 4 ranks and 8
    microbatches the simulated step is 29 units against 33 for 1F1B with
    B = 2 (the zero-bubble ideal is 27).
    """

    name = "zb_h1"

    @classmethod
    def programs(cls, num_stages: int, stages_per_rank: int, n_microbatches: int) -> dict[int, list[Action]]:
        world = _one_per_rank(cls.name, num_stages, stages_per_rank)
        compute: dict[int, list[Action]] = {}
        for r in range(world):
            order1f1b = _one_f_one_b(r, world, n_microbatches)
            last_forward = max(i for i, (kind, _) in enumerate(order1f1b) if kind == Kind.F)
            order: list[Action] = []
            pending: list[int] = []
            for i, (kind, mb) in enumerate(order1f1b):
                order.append(Action(r, mb, kind))
                if kind == Kind.B:
                    pending.append(mb)
                    limit = r if i < last_forward else 0
                    while len(pending) > limit:
                        order.append(Action(r, pending.pop(0), Kind.W))
            compute[r] = order
        return with_communication(compute, num_stages)


@hookimpl
def spmd_schedules() -> list[type]:
    """The schedules that ship with spmd."""
    return [GPipe, OneFOneB, Interleaved1F1B, ZeroBubbleH1]
