"""The schedule registry: every ``spmd_schedules`` class by name (the generic ``spmd.registry.Registry``)."""

from __future__ import annotations

import functools
from typing import Any

from spmd import hookspecs
from spmd.errors import NotProvidedError
from spmd.pipeline.actions import Action
from spmd.pipeline.validate import validate
from spmd.registry import Registry


class ScheduleNotFoundError(NotProvidedError):
    """No loaded plugin provides a schedule of the requested name."""


def _is_schedule(cls: object) -> bool:
    from spmd.pipeline.schedule import Schedule

    return isinstance(cls, type) and issubclass(cls, Schedule) and isinstance(getattr(cls, "name", None), str)


_HINT = "A schedule comes from a plugin's spmd_schedules() hook; check what is installed with `spmd plugins`"
SCHEDULES: Registry[str, type] = Registry(
    hookspecs.spmd_schedules, "pipeline schedule", plural="schedules", accepts=_is_schedule, missing=ScheduleNotFoundError,
    expected="a subclass of spmd.pipeline.Schedule with a str `name`", how_to_override="set overrides = True on the class that should win", hint=_HINT)


def schedules() -> dict[str, tuple[type, str]]:
    """Every registered schedule class and the plugin that provided it, by name."""
    return {name: (entry.spec, entry.plugin) for name, entry in SCHEDULES.entries().items()}


def schedule_names() -> list[str]:
    """The names of every registered schedule, sorted."""
    return SCHEDULES.keys()


def get_schedule(name: str) -> Any:
    """The schedule class called ``name`` (``gpipe``, ``1f1b``, ...), or an error listing the available ones.

    >>> programs = get_schedule("1f1b").programs(4, 1, 8)      # {rank: [Action, ...]}
    >>> schedule = get_schedule("1f1b")(stage, 8, loss_fn=loss_fn)
    """
    return SCHEDULES.get(name).spec


@functools.lru_cache(maxsize=256)
def validated_programs(cls: type, num_stages: int, stages_per_rank: int, n_microbatches: int) -> dict[int, tuple[Action, ...]]:
    """``cls.programs(...)``, validated once per arguments (a buggy schedule fails here, never as a hang)."""
    from spmd.pipeline.validate import ScheduleError

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
