"""``simulate(programs, costs)``: the timeline, bubble fraction and peak live activations of a schedule."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from spmd.pipeline.actions import COMPUTE, RECVS, SENDS, Action, Kind
from spmd.pipeline.validate import validate

#: Costs: a number per kind (missing kinds cost 0; the default is F = B = W = 1, transfers free),
#: or a function of the action (per-stage costs measured by a benchmark, say).
Costs = Mapping[str, float] | Callable[[Action], float]

UNIT_COSTS: dict[str, float] = {"F": 1.0, "B": 1.0, "W": 1.0}


@dataclass(frozen=True)
class Event:
    """One action on the timeline: rank, action, start and end time."""

    rank: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Simulation:
    """What ``simulate`` returns.

    ``bubble_fraction`` is the idle share of compute time: 1 - busy / (ranks x makespan),
    where busy counts F, B and W only. ``peak_activations[rank]`` is the most
    microbatches whose forward ran and whose last backward step (B, or W when
    the program has one) had not, at any time on that rank.
    """

    timeline: list[Event]
    makespan: float
    bubble_fraction: float
    peak_activations: dict[int, int]
    busy: dict[int, float]


def _cost_fn(costs: Costs | None) -> Callable[[Action], float]:
    if costs is None:
        costs = UNIT_COSTS
    if callable(costs):
        return costs
    table = {str(k): float(v) for k, v in costs.items()}
    return lambda a: table.get(a.kind.value, 0.0)


def simulate(programs: Mapping[int, Sequence[Action]], costs: Costs | None = None, *, latency: float = 0.0) -> Simulation:
    """Run the programs on a model clock: each rank in order, a receive starts no sooner than its send ended plus ``latency``.

    Validates first (a program that would hang has no timeline). With unit
    costs (F = B = 1) GPipe and 1F1B on P ranks with M microbatches have a
    bubble of (P - 1) / (M + P - 1); 1F1B keeps at most P microbatches'
    activations live, GPipe keeps M.

    >>> sim = simulate(get_schedule("gpipe").programs(4, 1, 8), {"F": 1, "B": 1})
    >>> round(sim.bubble_fraction, 4)   # 3 / 11
    0.2727
    """
    validate(programs)
    cost = _cost_fn(costs)
    world = len(programs)
    clock = [0.0] * world
    pc = [0] * world
    arrival: dict[Action, float] = {}  # send -> time its data is available at the receiver
    timeline: list[Event] = []
    has_w = {r: any(a.kind == Kind.W for a in programs[r]) for r in range(world)}
    live = [0] * world
    peak = [0] * world
    busy = [0.0] * world
    progress = True
    while progress:
        progress = False
        for rank in range(world):
            program = programs[rank]
            while pc[rank] < len(program):
                a = program[pc[rank]]
                start = clock[rank]
                if a.kind in RECVS:
                    send = a.peer()
                    if send not in arrival:
                        break
                    start = max(start, arrival[send])
                end = start + cost(a)
                if a.kind in SENDS:
                    arrival[a] = end + latency
                if a.kind in COMPUTE:
                    busy[rank] += end - start
                if a.kind == Kind.F:
                    live[rank] += 1
                    peak[rank] = max(peak[rank], live[rank])
                elif a.kind == (Kind.W if has_w[rank] else Kind.B):
                    live[rank] -= 1
                timeline.append(Event(rank, a, start, end))
                clock[rank] = end
                pc[rank] += 1
                progress = True
    makespan = max(clock, default=0.0)
    total = makespan * world
    bubble = 1.0 - sum(busy) / total if total > 0 else 0.0
    return Simulation(
        timeline=sorted(timeline, key=lambda e: (e.start, e.rank)),
        makespan=makespan,
        bubble_fraction=bubble,
        peak_activations=dict(enumerate(peak)),
        busy=dict(enumerate(busy)),
    )
