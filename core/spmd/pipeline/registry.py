"""The schedule registry: every ``spmd_schedules`` class by name, collected once from the plugins."""

from __future__ import annotations

import functools
from typing import Any

from spmd.errors import PluginConflictError, SpmdError
from spmd.pipeline.actions import Action
from spmd.pipeline.validate import validate
from spmd.plugins import HookTable


class ScheduleNotFoundError(SpmdError, LookupError):
    """No loaded plugin provides a schedule of the requested name."""


def _collect(pm: Any) -> dict[str, tuple[type, str]]:
    from spmd.pipeline.schedule import Schedule

    entries: dict[str, tuple[type, str]] = {}
    for plugin, classes in pm.hook_results("spmd_schedules"):
        for cls in classes:
            if not (isinstance(cls, type) and issubclass(cls, Schedule)) or not isinstance(getattr(cls, "name", None), str):
                raise TypeError(
                    f"plugin {plugin!r} returned {cls!r} from spmd_schedules; expected a subclass of "
                    "spmd.pipeline.Schedule with a str `name`"
                )
            previous = entries.get(cls.name)
            overrides = getattr(cls, "overrides", False)
            if previous is not None and not (overrides or getattr(previous[0], "overrides", False)):
                raise PluginConflictError(
                    f"schedule {cls.name!r} is provided by two plugins: {previous[1]!r} ({previous[0].__qualname__}) "
                    f"and {plugin!r} ({cls.__qualname__}). Uninstall one, block one with SPMD_BLOCK_PLUGINS={plugin}, "
                    "or set overrides = True on the class that should win"
                )
            if previous is not None and getattr(previous[0], "overrides", False) and not overrides:
                continue
            entries[cls.name] = (cls, plugin)
    return entries


_table = HookTable(_collect)


def schedules() -> dict[str, tuple[type, str]]:
    """Every registered schedule class and the plugin that provided it, by name."""
    return _table.get()


def schedule_names() -> list[str]:
    """The names of every registered schedule, sorted."""
    return sorted(schedules())


def get_schedule(name: str) -> Any:
    """The schedule class called ``name`` (``gpipe``, ``1f1b``, ...), or an error listing the available ones.

    >>> programs = get_schedule("1f1b").programs(4, 1, 8)      # {rank: [Action, ...]}
    >>> schedule = get_schedule("1f1b")(stage, 8, loss_fn=loss_fn)
    """
    entry = schedules().get(name)
    if entry is None:
        available = ", ".join(schedule_names()) or "none"
        raise ScheduleNotFoundError(
            f"unknown pipeline schedule {name!r}; available schedules: {available}. A schedule comes from a "
            "plugin's spmd_schedules() hook; check what is installed with `spmd plugins`"
        )
    return entry[0]


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
