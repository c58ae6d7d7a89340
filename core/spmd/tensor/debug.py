"""CommDebugMode: count the collectives DTensor issues, per module and per aten op, with their bytes.

    with spmd.tensor.CommDebugMode(root=model) as comm:
        model(x).sum().backward()
    comm.get_total_counts()                 # 4
    comm.get_comm_counts()                  # {"all_gather": 2, "reduce_scatter": 2}
    comm.per_module["layers.0.mlp"]         # {("all_gather", "aten.mm.default"): Count(calls=1, bytes=...)}

Collectives in backward are attributed to the module ``"(backward)"``.
Like torch's ``CommDebugMode``, but keyed by spmd's own collective names and
counting bytes; it sees only what DTensor issues, not direct ``spmd.*`` calls.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from spmd.tensor.visualize import visualize_sharding

__all__ = ["CommDebugMode", "Count", "visualize_sharding"]

_active: list[CommDebugMode] = []
#: The aten op being dispatched, set by the DTensor dispatcher while it runs (named only when recorded).
current_op: list[Any] = []


@dataclass
class Count:
    calls: int = 0
    bytes: int = 0


def record(collective: str, nbytes: int, group: Any) -> None:
    """Tell every active CommDebugMode about one collective (a no-op when none is active)."""
    if _active:
        for mode in _active:
            mode._add(collective, nbytes)


class CommDebugMode:
    """A context manager that counts DTensor's collectives while it is active."""

    def __init__(self, root: torch.nn.Module | None = None) -> None:
        self._names: dict[int, str] = {}
        if root is not None:
            self._names = {id(m): name or "(root)" for name, m in root.named_modules()}
        self.counts: dict[str, Count] = defaultdict(Count)
        self.per_module: dict[str, dict[tuple[str, str], Count]] = defaultdict(lambda: defaultdict(Count))
        self._stack: list[str] = []
        self._handles: list[Any] = []

    def _add(self, collective: str, nbytes: int) -> None:
        count = self.counts[collective]
        count.calls += 1
        count.bytes += nbytes
        if torch._C._current_graph_task_id() != -1:
            module = "(backward)"
        else:
            module = self._stack[-1] if self._stack else "(global)"
        op = str(current_op[-1]) if current_op else "(redistribute)"
        entry = self.per_module[module][(collective, op)]
        entry.calls += 1
        entry.bytes += nbytes

    def get_total_counts(self) -> int:
        return sum(c.calls for c in self.counts.values())

    def get_comm_counts(self) -> dict[str, int]:
        return {name: c.calls for name, c in self.counts.items()}

    def get_comm_bytes(self) -> dict[str, int]:
        return {name: c.bytes for name, c in self.counts.items()}

    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        self._stack.append(self._names.get(id(module), type(module).__name__))

    def _post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._stack:
            self._stack.pop()

    def __enter__(self) -> CommDebugMode:
        from torch.nn.modules import module as nn_module

        self._handles = [
            nn_module.register_module_forward_pre_hook(self._pre),
            nn_module.register_module_forward_hook(self._post),
        ]
        _active.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _active.remove(self)
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def table(self) -> str:
        """The counts as text: one line per module, collective and op."""
        lines = []
        for module, entries in self.per_module.items():
            for (collective, op), c in entries.items():
                lines.append(f"{module:30s} {collective:15s} {op:40s} {c.calls:5d} {c.bytes:12d} B")
        return "\n".join(lines)
