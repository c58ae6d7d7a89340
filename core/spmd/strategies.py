"""The strategy registry: every ``spmd_strategies`` spec by name (the generic ``spmd.registry.Registry``).

Below both ``spmd.parallel`` (DDP, FSDP) and ``spmd.tensor.parallel`` (the TP styles), which register and read it.
"""

from __future__ import annotations

from spmd import hookspecs
from spmd.errors import NotProvidedError
from spmd.registry import Entry, Registry
from spmd.specs import StrategySpec


class StrategyNotFoundError(NotProvidedError):
    """No loaded plugin provides a strategy of the requested name."""


#: A StrategySpec and the plugin that provided it.
RegisteredStrategy = Entry[str, StrategySpec]

_HINT = "A strategy comes from a plugin's spmd_strategies() hook; check what is installed with `spmd plugins`"
STRATEGIES: Registry[str, StrategySpec] = Registry(
    hookspecs.spmd_strategies, "strategy", StrategySpec, plural="strategies", missing=StrategyNotFoundError, hint=_HINT)


def strategies() -> dict[str, RegisteredStrategy]:
    """Every registered strategy by name (rebuilt when the plugins change)."""
    return STRATEGIES.entries()


def strategy_names() -> list[str]:
    """The names of every registered strategy, sorted."""
    return STRATEGIES.keys()


def get_strategy(name: str) -> StrategySpec:
    """The strategy called ``name``, or an error listing the available ones."""
    return STRATEGIES.get(name).spec
