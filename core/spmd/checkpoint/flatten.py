"""Nested state dicts to flat ``dotted.key -> leaf`` maps, and writing loaded leaves back in place.

Dicts are always walked; lists and tuples only when they hold a tensor
somewhere (an optimizer's ``betas`` stays one JSON value). Every other leaf
must be JSON-serialisable: a checkpoint stores no pickles.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from spmd.checkpoint.metadata import CheckpointError

Path = tuple[Any, ...]


@dataclass(frozen=True)
class Leaf:
    """One leaf of a state dict: its flat key, its container and index in it, its value."""

    key: str
    container: Any
    index: Any
    value: Any


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, Mapping):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    return False


def leaves(state_dict: Mapping[str, Any]) -> Iterator[Leaf]:
    """Every leaf of ``state_dict`` with its flat key (path parts joined by dots)."""

    def walk(container: Any, prefix: str) -> Iterator[Leaf]:
        items = container.items() if isinstance(container, Mapping) else enumerate(container)
        for index, value in items:
            key = f"{prefix}{index}"
            if isinstance(value, Mapping) and value:
                yield from walk(value, key + ".")
            elif isinstance(value, (list, tuple)) and _holds_tensor(value):
                yield from walk(value, key + ".")
            else:
                yield Leaf(key, container, index, value)

    yield from walk(state_dict, "")


def json_value(key: str, value: Any) -> Any:
    """``value`` as JSON data (tuples become lists), or an error naming the key and the way out."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError):
        raise CheckpointError(
            f"state_dict[{key!r}] is a {type(value).__name__}, which is neither a tensor nor JSON data; "
            "spmd checkpoints store no pickles: store it as a tensor, or as numbers, strings, lists and dicts"
        ) from None


def shaped_like(old: Any, stored: Any) -> Any:
    """``stored`` (JSON data) with the tuples that ``old`` had where it has lists."""
    if isinstance(old, tuple) and isinstance(stored, list) and len(old) == len(stored):
        return tuple(shaped_like(o, n) for o, n in zip(old, stored))
    if isinstance(old, list) and isinstance(stored, list) and len(old) == len(stored):
        return [shaped_like(o, n) for o, n in zip(old, stored)]
    if isinstance(old, Mapping) and isinstance(stored, dict):
        return {k: shaped_like(old.get(k), v) for k, v in stored.items()}
    return stored


def restore_value(key: str, leaf: Leaf, stored: Any) -> None:
    """Put a loaded JSON value back where ``leaf`` was, as a tuple if the old value was one."""
    value = shaped_like(leaf.value, stored)
    if isinstance(leaf.container, tuple):
        if leaf.container[leaf.index] != value:
            raise CheckpointError(f"state_dict[{key!r}] sits in a tuple and cannot be replaced in place; use a list")
        return
    leaf.container[leaf.index] = value
