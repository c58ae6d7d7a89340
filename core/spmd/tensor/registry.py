"""The rule registry: every ``spmd_sharding_rules`` mapping merged (the generic ``spmd.registry.Registry``).

A plugin's rule for an op the builtin rules already cover is a conflict unless
the plugin maps the op to ``spmd.Overriding(rule)``: then its rule is used.
"""

from __future__ import annotations

import torch

from spmd import hookspecs
from spmd.registry import Registry
from spmd.tensor.rule import Decompose, Rule

#: What rules are keyed by: an op overload, or a packet (every overload of the op).
OpKey = torch._ops.OpOverload | torch._ops.OpOverloadPacket
#: What a rule plugin maps an op to.
RuleSpec = Rule | Decompose


def _is_op(op: object) -> bool:
    return isinstance(op, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))


_OPS = "keys must be aten op overloads such as torch.ops.aten.mm.default (or packets such as torch.ops.aten.mm)"
RULES: Registry[OpKey, RuleSpec] = Registry(
    hookspecs.spmd_sharding_rules, "sharding rule", keys=None, accepts=lambda rule: callable(rule) or isinstance(rule, Decompose),
    expected="a rule (a callable or spmd.tensor.Decompose)", accepts_key=_is_op, expected_key=_OPS)


def lookup(op: torch._ops.OpOverload) -> RuleSpec | None:
    """The rule for ``op`` (an overload's own rule first, then its packet's), or None; memoised per op and generation."""
    table = RULES.table()
    try:
        return table.memo[op]
    except KeyError:
        pass
    entry = table.entries.get(op) or table.entries.get(op.overloadpacket)
    rule: RuleSpec | None = entry.spec if entry is not None else None
    table.memo[op] = rule
    return rule


def owner(op: torch._ops.OpOverload) -> str | None:
    """The plugin that provided ``op``'s rule."""
    entries = RULES.entries()
    entry = entries.get(op) or entries.get(op.overloadpacket)
    return entry.plugin if entry is not None else None


def rules() -> dict[OpKey, RuleSpec]:
    """Every registered rule by op (a copy)."""
    return {op: entry.spec for op, entry in RULES.entries().items()}
