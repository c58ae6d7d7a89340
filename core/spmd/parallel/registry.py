"""The strategy registry under ``spmd.parallel`` (it lives in ``spmd.strategies``, below the TP styles that read it)."""

from spmd.strategies import (
    STRATEGIES,
    RegisteredStrategy,
    StrategyNotFoundError,
    StrategySpec,
    get_strategy,
    strategies,
    strategy_names,
)

__all__ = [
    "STRATEGIES",
    "RegisteredStrategy",
    "StrategyNotFoundError",
    "StrategySpec",
    "get_strategy",
    "strategies",
    "strategy_names",
]
