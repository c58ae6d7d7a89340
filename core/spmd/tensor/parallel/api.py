"""parallelize_module: apply tensor-parallel styles to a module's submodules by (wildcard) name.

    parallelize_module(model, mesh["tp"], {
        "embed": RowwiseParallel(),
        "layers.*.mlp.fc1": ColwiseParallel(),
        "layers.*.mlp.fc2": "rowwise",               # a style by its registered name
    })

A plan value is a ``ParallelStyle`` or the name of one registered through
``spmd_strategies`` as ``StrategySpec("tp.<name>", apply=StyleClass)`` (the
builtin names: colwise, rowwise, sequence); keys are dotted module names where
each part may be an ``fnmatch`` pattern (``*``, ``?``, ``[ab]``), as torch
accepts. Works in place and returns the module.
"""

from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatch
from typing import TypeAlias

from torch import nn

from spmd.comm.agreement import verify_agreement
from spmd.mesh import DeviceMesh
from spmd.tensor.parallel.style import ParallelStyle
from spmd.tensor.placements import Placement

STYLE_PREFIX = "tp."
#: A style, or the name of a registered one ("colwise", ...).
StyleLike: TypeAlias = ParallelStyle | str
#: What ``parallelize_module`` takes: one style for the module, or module-name patterns to styles.
Plan: TypeAlias = StyleLike | Mapping[str, StyleLike]


def resolve_style(style: StyleLike) -> ParallelStyle:
    """A style object, or the registered style called ``style`` (an instance with default options)."""
    if isinstance(style, str):
        from spmd.strategies import get_strategy

        resolved: ParallelStyle = get_strategy(STYLE_PREFIX + style).apply()
        return resolved
    if not hasattr(style, "apply"):
        raise TypeError(
            f"parallelize_module: {style!r} is not a parallel style; pass a spmd.parallel.ParallelStyle "
            "(ColwiseParallel(), ...) or a registered style's name"
        )
    return style


def _matches(name: str, pattern: str) -> bool:
    parts, atoms = name.split("."), pattern.split(".")
    return len(parts) == len(atoms) and all(fnmatch(p, a) for p, a in zip(parts, atoms))


def _describe_style(style: StyleLike) -> str:
    """A style as comparable text: its class and settings (placements, dims, flags)."""
    if isinstance(style, str):
        return style
    settings = sorted((k, repr(v) if isinstance(v, (Placement, int, float, str, bool, tuple, list, type(None)))
                       else type(v).__name__) for k, v in vars(style).items())
    return f"{type(style).__name__}{settings}"


def _verify_plan(module: nn.Module, mesh: DeviceMesh, plan: Mapping[str, StyleLike]) -> None:
    """Every rank of the mesh applies the same plan to the same parameters, or every rank raises naming the
    difference (a plan on one rank only gave wrong activations without an error)."""
    entries: list[object] = [(pattern, _describe_style(style)) for pattern, style in plan.items()]
    entries += [(name, tuple(p.shape), str(p.dtype)) for name, p in module.named_parameters()]
    for group in mesh.get_all_groups():
        verify_agreement(entries, group, "parallelize_module",
                         "apply different plans or hold different parameters (plan entries, then parameters)",
                         "Apply the same plan to the same model on every rank")


def parallelize_module(module: nn.Module, device_mesh: DeviceMesh, parallelize_plan: Plan | None = None) -> nn.Module:
    """Apply ``parallelize_plan`` (one style for ``module`` itself, or a dict from module names to styles)."""
    if parallelize_plan is None:
        return module
    if not isinstance(parallelize_plan, Mapping):
        if not isinstance(parallelize_plan, (ParallelStyle, str)) and not hasattr(parallelize_plan, "apply"):
            raise TypeError(f"parallelize_module: the plan must be a style or a dict of module names to styles, got {type(parallelize_plan).__name__}")
        _verify_plan(module, device_mesh, {"": parallelize_plan})
        return resolve_style(parallelize_plan).apply(module, device_mesh)
    named = dict(module.named_modules())
    _verify_plan(module, device_mesh, parallelize_plan)
    for pattern, style in parallelize_plan.items():
        found = [name for name in named if name and _matches(name, pattern)]
        if not found:
            raise ValueError(
                f"parallelize_module: plan key {pattern!r} matches no submodule of {type(module).__name__}; "
                f"its submodules include {[n for n in named if n][:8]}"
            )
        resolved = resolve_style(style)
        for name in found:
            resolved.apply(named[name], device_mesh)
    return module
