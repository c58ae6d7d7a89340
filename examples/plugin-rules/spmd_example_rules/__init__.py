"""A custom elementwise op and its DTensor sharding rule, provided as an spmd plugin."""

from __future__ import annotations

from typing import Any

import torch

import spmd
from spmd.tensor import pointwise_rule

_lib = torch.library.Library("spmd_example", "DEF")
_lib.define("scaled_gelu(Tensor x, float scale) -> Tensor")


@torch.library.impl(_lib, "scaled_gelu", "CPU")
def _scaled_gelu(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.nn.functional.gelu(x) * scale


@torch.library.register_fake("spmd_example::scaled_gelu")
def _scaled_gelu_meta(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(x)


@spmd.hookimpl
def spmd_sharding_rules() -> dict[Any, Any]:
    """The op is elementwise: the ready-made pointwise rule keeps any shard."""
    return {torch.ops.spmd_example.scaled_gelu.default: pointwise_rule}
