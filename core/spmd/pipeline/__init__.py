"""Pipeline parallelism: a public action IR, schedules as plugins, a validator, a simulator and one runtime.

>>> programs = spmd.pipeline.get_schedule("1f1b").programs(4, 1, 8)     # {rank: [Action, ...]}
>>> spmd.pipeline.validate(programs)
>>> spmd.pipeline.simulate(programs, {"F": 1, "B": 2}).bubble_fraction
>>> stage = spmd.pipeline.PipelineStage(piece, rank, 4, "cpu")
>>> schedule = spmd.pipeline.get_schedule("1f1b")(stage, 8, loss_fn=loss_fn)
>>> schedule.step(x)                              # first stage; last: step(target=y, losses=losses)

See docs/pipeline.md.
"""

from spmd.pipeline.actions import (
    Action,
    Kind,
    Programs,
    format_program,
    stage_rank,
    with_communication,
)
from spmd.pipeline.registry import (
    ScheduleNotFoundError,
    get_schedule,
    schedule_names,
)
from spmd.pipeline.schedule import Schedule
from spmd.pipeline.simulate import Event, Simulation, simulate
from spmd.pipeline.stage import PipelineStage, split_module
from spmd.pipeline.validate import ScheduleError, validate, validated_programs

__all__ = [
    "Action",
    "Event",
    "Kind",
    "PipelineStage",
    "Programs",
    "Schedule",
    "ScheduleError",
    "ScheduleNotFoundError",
    "Simulation",
    "format_program",
    "get_schedule",
    "schedule_names",
    "simulate",
    "split_module",
    "stage_rank",
    "validate",
    "validated_programs",
    "with_communication",
]
