"""The strategy registry: every ``spmd_strategies`` spec by name, collected once from the plugins."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spmd.errors import PluginConflictError, SpmdError
from spmd.plugins import HookTable


@dataclass(frozen=True)
class StrategySpec:
    """A parallelism strategy a plugin provides: ``apply(module, **options)`` returns the parallel module."""

    name: str
    apply: Callable[..., Any]
    description: str = ""
    overrides: bool = False  # True: wins over a same-named spec from another plugin


class StrategyNotFoundError(SpmdError, LookupError):
    """No loaded plugin provides a strategy of the requested name."""


@dataclass(frozen=True)
class RegisteredStrategy:
    """A StrategySpec and the plugin that provided it."""

    spec: StrategySpec
    plugin: str


def _collect(pm: Any) -> dict[str, RegisteredStrategy]:
    entries: dict[str, RegisteredStrategy] = {}
    for plugin, specs in pm.hook_results("spmd_strategies"):
        for spec in specs:
            if not isinstance(spec, StrategySpec):
                raise TypeError(
                    f"plugin {plugin!r} returned {spec!r} from spmd_strategies; "
                    "expected spmd.parallel.StrategySpec"
                )
            previous = entries.get(spec.name)
            if previous is not None and not (spec.overrides or previous.spec.overrides):
                raise PluginConflictError(
                    f"strategy {spec.name!r} is provided by two plugins: {previous.plugin!r} and "
                    f"{plugin!r}. Uninstall one, block one with SPMD_BLOCK_PLUGINS={plugin}, or "
                    "declare overrides=True in the StrategySpec that should win"
                )
            if previous is not None and previous.spec.overrides and not spec.overrides:
                continue
            entries[spec.name] = RegisteredStrategy(spec, plugin)
    return entries


_table = HookTable(_collect)


def strategies() -> dict[str, RegisteredStrategy]:
    """Every registered strategy by name (rebuilt when the plugins change)."""
    return _table.get()


def strategy_names() -> list[str]:
    """The names of every registered strategy, sorted."""
    return sorted(strategies())


def get_strategy(name: str) -> StrategySpec:
    """The strategy called ``name``, or an error listing the available ones."""
    entry = strategies().get(name)
    if entry is None:
        available = ", ".join(strategy_names()) or "none"
        raise StrategyNotFoundError(
            f"unknown strategy {name!r}; available strategies: {available}. A strategy comes "
            "from a plugin's spmd_strategies() hook; check what is installed with `spmd plugins`"
        )
    return entry.spec
