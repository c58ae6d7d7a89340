"""CommDebugMode: count the collectives DTensor issues, per module and per aten op, with their bytes.

    with spmd.tensor.CommDebugMode(root=model) as comm:
        model(x).sum().backward()
    comm.get_total_counts()                 # 4
    comm.get_comm_counts()                  # {"all_gather": 2, "reduce_scatter": 2}
    comm.per_module["layers.0.mlp"]         # {("all_gather", "aten.mm.default"): Count(calls=1, bytes=...)}

Collectives in backward are attributed to the module ``"(backward)"``.
Like torch's ``CommDebugMode``, but keyed by spmd's own collective names and
counting bytes (of the op's largest buffer). It counts from the kernel's op
lifecycle (an observer of the flight recorder), so it sees every collective
this process issues while it is active: DTensor's, FSDP's, direct ``spmd.*``
calls; point-to-point sends and receives are not counted.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch.utils.hooks import RemovableHandle

from spmd.debug.recorder import recorder
from spmd.tensor.dispatch import dispatcher
from spmd.tensor.visualize import visualize_sharding

__all__ = ["CommDebugMode", "Count", "counted_as", "visualize_sharding"]

#: The kernel's op names -> the names counts are kept under (torch's CommDebugMode's short ones).
_NAMES = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter", "all_to_all_single": "all_to_all"}
#: Set by ``counted_as``: the name the collectives issued inside count under.
_stand_in: contextvars.ContextVar[str | None] = contextvars.ContextVar("spmd_counted_as", default=None)


@contextlib.contextmanager
def counted_as(name: str) -> Iterator[None]:
    """Count the collectives issued inside as ``name``: an op standing in for another (FSDP reduces gradients
    with an all-reduce where the backend's reduce-scatter would copy its input anyway: still a reduce-scatter)."""
    token = _stand_in.set(name)
    try:
        yield
    finally:
        _stand_in.reset(token)


@dataclass
class Count:
    calls: int = 0
    bytes: int = 0


class CommDebugMode:
    """A context manager that counts the collectives this process issues while it is active."""

    def __init__(self, root: torch.nn.Module | None = None) -> None:
        self._names: dict[int, str] = {}
        if root is not None:
            self._names = {id(m): name or "(root)" for name, m in root.named_modules()}
        self.counts: dict[str, Count] = defaultdict(Count)
        self.per_module: dict[str, dict[tuple[str, str], Count]] = defaultdict(lambda: defaultdict(Count))
        self._stack: list[str] = []
        self._handles: list[RemovableHandle] = []

    def _observe(self, group: str, seq: int, op: str, shapes: Sequence[torch.Size], dtypes: Sequence[torch.dtype]) -> None:
        """The flight recorder's report of one op: count it unless it is point-to-point (``seq`` -1)."""
        if seq < 0:
            return
        nbytes = max((shape.numel() * dtype.itemsize for shape, dtype in zip(shapes, dtypes)), default=0)
        self._add(_stand_in.get() or _NAMES.get(op, op), nbytes)

    def _add(self, collective: str, nbytes: int) -> None:
        count = self.counts[collective]
        count.calls += 1
        count.bytes += nbytes
        if torch._C._current_graph_task_id() != -1:
            module = "(backward)"
        else:
            module = self._stack[-1] if self._stack else "(global)"
        current = dispatcher.current_op
        op = str(current[-1]) if current else "(redistribute)"
        entry = self.per_module[module][(collective, op)]
        entry.calls += 1
        entry.bytes += nbytes

    def get_total_counts(self) -> int:
        return sum(c.calls for c in self.counts.values())

    def get_comm_counts(self) -> dict[str, int]:
        return {name: c.calls for name, c in self.counts.items()}

    def get_comm_bytes(self) -> dict[str, int]:
        return {name: c.bytes for name, c in self.counts.items()}

    def _pre(self, module: torch.nn.Module, args: object) -> None:
        self._stack.append(self._names.get(id(module), type(module).__name__))

    def _post(self, module: torch.nn.Module, args: object, output: object) -> None:
        if self._stack:
            self._stack.pop()

    def __enter__(self) -> CommDebugMode:
        from torch.nn.modules import module as nn_module

        self._handles = [
            nn_module.register_module_forward_pre_hook(self._pre),
            nn_module.register_module_forward_hook(self._post),
        ]
        recorder.observers.append(self._observe)
        return self

    def __exit__(self, *exc: object) -> None:
        recorder.observers.remove(self._observe)
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
