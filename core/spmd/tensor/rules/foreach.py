"""The ``_foreach_*`` ops torch's optimizers use, as per-tensor DTensor ops (each with its own rule).

``_foreach_add_(params, grads, alpha=a)`` becomes ``add_(params[i], grads[i], alpha=a)`` for each i,
so every parameter keeps its own placement, whatever its neighbours' are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from spmd.tensor.rule import Decompose

aten = torch.ops.aten

#: Per-tensor ops whose trailing argument is keyword-only.
_KEYWORD_VALUE = {"addcmul", "addcdiv"}
#: foreach names whose per-tensor op has another name.
_RENAMED = {"norm": "linalg_vector_norm", "max": "amax"}


def _per_tensor(name: str) -> Callable[..., Any]:
    in_place = name.endswith("_")
    base = name[len("_foreach_") :].rstrip("_")
    base = _RENAMED.get(base, base)
    packet = getattr(aten, base + "_", None) if in_place else None
    functional = getattr(aten, base)

    def run(*args: Any, **kwargs: Any) -> Any:
        tensors = args[0]
        count = len(tensors)
        results = []
        for i in range(count):
            call_args = [a[i] if isinstance(a, (list, tuple)) and len(a) == count else a for a in args]
            call_kwargs = dict(kwargs)
            if base in _KEYWORD_VALUE and len(call_args) == 4:
                call_kwargs["value"] = call_args.pop()
            if in_place and packet is not None:
                packet(*call_args, **call_kwargs)
            elif in_place:
                tensors[i].copy_(functional(*call_args, **call_kwargs))
            else:
                results.append(functional(*call_args, **call_kwargs))
        return None if in_place else results

    return run


def rules() -> dict[Any, Any]:
    table: dict[Any, Any] = {}
    for name in dir(aten):
        if not name.startswith("_foreach_"):
            continue
        base = name[len("_foreach_") :].rstrip("_")
        if not hasattr(aten, _RENAMED.get(base, base)):
            continue
        decompose = Decompose(_per_tensor(name))
        packet = getattr(aten, name)
        for overload in packet.overloads():
            if "out" not in overload:
                table[getattr(packet, overload)] = decompose
    return table
