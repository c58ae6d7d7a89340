"""Which parameters the autograd graph of a forward's outputs reaches."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch


def output_tensors(output: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside a forward's output (nested tuples, lists, dicts, dataclass-like objects)."""
    stack = [output]
    seen: set[int] = set()
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            yield item
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, Mapping):
            stack.extend(item.values())
        elif hasattr(item, "__dict__") and id(item) not in seen and not isinstance(item, type):
            seen.add(id(item))  # e.g. a ModelOutput dataclass
            stack.extend(vars(item).values())


def reached_parameters(output: Any) -> set[int]:
    """ids of the leaf tensors that gradients from ``output`` flow into (AccumulateGrad nodes)."""
    reached: set[int] = set()
    seen: set[Any] = set()
    stack = [t.grad_fn for t in output_tensors(output) if t.grad_fn is not None]
    for t in output_tensors(output):
        if t.grad_fn is None and t.requires_grad:
            reached.add(id(t))  # the output is a parameter itself
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            reached.add(id(variable))
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                stack.append(child)
    return reached
