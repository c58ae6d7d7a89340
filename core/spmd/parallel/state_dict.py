"""State dicts without the wrapper's ``module.`` prefix, loadable with or without it."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

WRAPPED = "module."


def strip_prefix(state_dict: Mapping[str, Any]) -> OrderedDict[str, Any]:
    """A copy of ``state_dict`` with a leading ``module.`` removed from every key that has one."""
    copy: OrderedDict[str, Any] = OrderedDict(state_dict)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        copy._metadata = OrderedDict(metadata)  # type: ignore[attr-defined]
    if any(key.startswith(WRAPPED) for key in copy):
        consume_prefix_in_state_dict_if_present(copy, WRAPPED)
    return copy


def add_wrapped_prefix(module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    """Load pre-hook for a wrapper nested in another module: ``<prefix>x`` is read as ``<prefix>module.x``."""
    inner = prefix + WRAPPED
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix) :]] = state_dict.pop(key)
