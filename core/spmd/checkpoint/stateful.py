"""``Stateful``: an object that ``save`` and ``load`` checkpoint through its ``state_dict``/``load_state_dict``.

As ``torch.distributed.checkpoint.stateful.Stateful``: a runtime-checkable
Protocol, so a module, an optimizer or any object with both methods counts.
A top-level value of the state dict given to ``save`` that is Stateful is
saved as its ``state_dict()``; ``load`` fills that state dict in place, then
hands it to ``load_state_dict``.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any, Protocol, TypeVar, runtime_checkable


@runtime_checkable
class Stateful(Protocol):
    """An object checkpointed through ``state_dict()`` and restored through ``load_state_dict()``."""

    def state_dict(self) -> dict[str, Any]:
        """The object's state (also called by ``load``, which fills it in place)."""
        ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the object's state from what ``state_dict`` returned, filled by ``load``."""
        ...


StatefulT = TypeVar("StatefulT", bound=Stateful)


def expand_stateful(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """``state_dict`` with each top-level Stateful value replaced by its ``state_dict()`` (torch's DCP does the same)."""
    return {key: value.state_dict() if isinstance(value, Stateful) else value for key, value in state_dict.items()}


def restore_stateful(state_dict: MutableMapping[str, Any], loaded: Mapping[str, Any]) -> None:
    """After a load into ``loaded`` (from ``expand_stateful``): Stateful values get ``load_state_dict``, others the loaded value."""
    for key, value in list(state_dict.items()):
        if isinstance(value, Stateful):
            value.load_state_dict(loaded[key])
        elif loaded[key] is not value:
            state_dict[key] = loaded[key]
