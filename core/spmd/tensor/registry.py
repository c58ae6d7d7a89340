"""The rule registry: every ``spmd_sharding_rules`` mapping merged once, with conflicts named."""

from __future__ import annotations

from typing import Any

import torch

from spmd.errors import PluginConflictError
from spmd.plugins import HookTable


def _collect(pm: Any) -> tuple[dict[Any, Any], dict[Any, str]]:
    rules: dict[Any, Any] = {}
    owners: dict[Any, str] = {}
    for plugin, mapping in pm.hook_results("spmd_sharding_rules"):
        for op, rule in dict(mapping).items():
            if not isinstance(op, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
                raise TypeError(
                    f"plugin {plugin!r} returned a rule for {op!r} from spmd_sharding_rules; keys must be "
                    "aten op overloads such as torch.ops.aten.mm.default (or packets such as torch.ops.aten.mm)"
                )
            if op in rules:
                raise PluginConflictError(
                    f"two plugins provide a sharding rule for {op}: {owners[op]!r} and {plugin!r}. "
                    f"Uninstall one or block one with SPMD_BLOCK_PLUGINS={plugin}"
                )
            rules[op] = rule
            owners[op] = plugin
    return rules, owners


_table = HookTable(_collect)


def _tables() -> tuple[dict[Any, Any], dict[Any, str]]:
    return _table.get()


_resolved: dict[Any, Any] = {}
_resolved_for: object = None


def lookup(op: torch._ops.OpOverload) -> Any:
    """The rule for ``op`` (an overload's own rule first, then its packet's), or None; memoised per op."""
    global _resolved_for
    from spmd import plugins

    if _resolved_for is not plugins.generation:  # plugins were (re)loaded: resolve afresh
        _resolved.clear()
        _resolved_for = plugins.generation
    try:
        return _resolved[op]
    except KeyError:
        pass
    rules = _tables()[0]
    _resolved_for = plugins.generation
    rule = rules.get(op)
    if rule is None:
        rule = rules.get(op.overloadpacket)
    _resolved[op] = rule
    return rule


def owner(op: torch._ops.OpOverload) -> str | None:
    """The plugin that provided ``op``'s rule."""
    owners = _tables()[1]
    return owners.get(op) or owners.get(op.overloadpacket)


def rules() -> dict[Any, Any]:
    """Every registered rule by op (a copy)."""
    return dict(_tables()[0])
