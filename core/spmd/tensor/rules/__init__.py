"""The standard sharding rules: a builtin plugin, registered like any third-party rule plugin.

Each submodule covers one family of ops and exposes ``rules()``; this module
implements the ``spmd_sharding_rules`` hook with their union.
"""

from __future__ import annotations

from typing import Any

from spmd.markers import hookimpl
from spmd.tensor.rules import (
    complex_ops,
    factories,
    foreach,
    matrix,
    nn,
    pointwise,
    reduction,
    views,
)


@hookimpl
def spmd_sharding_rules() -> dict[Any, Any]:
    table: dict[Any, Any] = {}
    for family in (pointwise, complex_ops, matrix, reduction, views, nn, factories, foreach):
        table.update(family.rules())
    return table
