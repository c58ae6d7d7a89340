"""A third-party schedule plugin for test_pipeline.py: GPipe with backwards in reverse order, and a broken one."""

from __future__ import annotations

import spmd
from spmd.pipeline import Action, Kind, Schedule, with_communication


class ReverseGPipe(Schedule):
    """All forwards, then the backwards last-in first-out."""

    name = "test_reverse_gpipe"

    @classmethod
    def programs(cls, num_stages: int, stages_per_rank: int, n_microbatches: int) -> dict[int, list[Action]]:
        compute = {
            r: [Action(r, m, Kind.F) for m in range(n_microbatches)] + [Action(r, m, Kind.B) for m in reversed(range(n_microbatches))]
            for r in range(num_stages)
        }
        return with_communication(compute, num_stages)


class SplitsTheFirstBackward(Schedule):
    """GPipe whose first microbatch's backward is split into B and W; the later ones are whole and run after that W."""

    name = "test_splits_the_first_backward"

    @classmethod
    def programs(cls, num_stages: int, stages_per_rank: int, n_microbatches: int) -> dict[int, list[Action]]:
        compute = {
            r: [Action(r, m, Kind.F) for m in range(n_microbatches)] + [Action(r, 0, Kind.B), Action(r, 0, Kind.W)]
            + [Action(r, m, Kind.B) for m in range(1, n_microbatches)]
            for r in range(num_stages)
        }
        return with_communication(compute, num_stages)


class DropsAReceive(Schedule):
    """1F1B whose last rank forgets to receive microbatch 1: must fail at construction, never hang."""

    name = "test_drops_a_receive"

    @classmethod
    def programs(cls, num_stages: int, stages_per_rank: int, n_microbatches: int) -> dict[int, list[Action]]:
        programs = spmd.pipeline.get_schedule("1f1b").programs(num_stages, stages_per_rank, n_microbatches)
        last = num_stages - 1
        programs[last] = [a for a in programs[last] if a != Action(last, 1, Kind.RECV_F)]
        return programs


@spmd.hookimpl
def spmd_schedules() -> list[type]:
    """The test schedules."""
    return [ReverseGPipe, SplitsTheFirstBackward, DropsAReceive]
