"""The schedule registry: every ``spmd_schedules`` class by name (the generic ``spmd.registry.Registry``)."""

from __future__ import annotations

from typing import Any

from spmd import hookspecs
from spmd.errors import NotProvidedError
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
