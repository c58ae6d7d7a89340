"""The one registry (spmd.registry): the live registries walked, and conflicts, overrides, type checks,
not-found lists and generations on a hook of the test's own. One process, no world."""

from __future__ import annotations

import pathlib
import re
import types

import pytest
import torch
from test_plugins import add_entry_point, fresh_manager  # noqa: F401  (an autouse fixture: every test starts on a fresh manager)

import spmd
from spmd import hookspecs, plugins
from spmd.registry import ALL, Registry


def _live_registries() -> list[Registry]:
    """Every registry the kernel has (importing each module that makes one)."""
    import spmd.bench.worker
    import spmd.checkpoint.storage
    import spmd.comm.registry
    import spmd.launch.environments
    import spmd.launch.rdzv_backends
    import spmd.parallel.comm_hooks
    import spmd.parallel.registry
    import spmd.pipeline.registry
    import spmd.tensor.registry  # noqa: F401

    return list(ALL)


def test_every_hook_is_read_through_one_registry_with_a_spec_and_a_doc():
    """Walks the live hook specs and the live registries: each hook has exactly one registry (no registry
    of its own kind left), each registry's hook is a spec in spmd.hookspecs, documented in docs/hooks.md."""
    pm = plugins.manager()
    registries = _live_registries()
    docs = (pathlib.Path(__file__).parents[1] / "docs" / "hooks.md").read_text()
    by_hook = {}
    for registry in registries:
        assert registry.hook is getattr(hookspecs, registry.hook_name), registry.hook_name
        assert getattr(pm.hook, registry.hook_name).spec is not None
        assert re.search(rf"^## `{registry.hook_name}\(", docs, re.M), registry.hook_name
        by_hook.setdefault(registry.hook_name, []).append(registry)
    assert sorted(by_hook) == pm.hook_names()
    assert all(len(found) == 1 for found in by_hook.values()), by_hook


def test_every_builtin_entry_comes_from_a_builtin_plugin(monkeypatch):
    """With only the builtins loaded, everything every registry holds was given by one of spmd's builtin
    plugins (none is filled at import or by hand), and every builtin plugin gives something."""
    monkeypatch.setenv(plugins.ENV_DISABLE_AUTOLOAD, "1")
    pm = plugins.manager()
    givers = set()
    for registry in _live_registries():
        for key, entry in registry.entries().items():
            assert entry.key == key
            info = pm.infos.get(entry.plugin)
            assert info is not None and info.builtin and info.loaded, (registry.hook_name, key, entry.plugin)
            assert pm.get_plugin(entry.plugin) is not None
            givers.add(entry.plugin)
    expected = set(plugins.BUILTIN_PLUGINS)
    if spmd.checkpoint.storage.ANY_SCHEME not in spmd.checkpoint.storage.storages():
        expected.discard("spmd.checkpoint.fsspec_storage")  # it gives its scheme only where fsspec is installed
    assert givers == expected
    names = spmd.parallel.comm_hooks.hook_names()
    assert {"allreduce", "fp16", "bf16"} <= set(names)
    assert spmd.parallel.comm_hooks.COMM_HOOKS.get("allreduce").plugin == "spmd.parallel.builtin"


# -- the generic registry on a hook of the test's own -------------------------------------------------------


def _specs_module():
    module = types.ModuleType("widget_specs")

    @spmd.hookspec
    def spmd_widgets():
        """Signature: ``spmd_widgets() -> Iterable[Widget]``."""

    @spmd.hookspec
    def spmd_gadgets():
        """Signature: ``spmd_gadgets() -> Mapping[str, int]``."""

    module.spmd_widgets, module.spmd_gadgets = spmd_widgets, spmd_gadgets
    return module


class Widget:
    def __init__(self, name, overrides=False):
        self.name, self.overrides = name, overrides


def _plugin(name, **hooks):
    module = types.ModuleType(name)
    for hook, answer in hooks.items():
        setattr(module, hook, spmd.hookimpl(lambda answer=answer: answer))
    return module


@pytest.fixture
def widgets():
    specs = _specs_module()
    plugins.manager().add_hookspecs(specs)
    made = Registry(specs.spmd_widgets, "widget", Widget, expected="a Widget",
                    hint="Install a widget plugin")
    gadgets = Registry(specs.spmd_gadgets, "gadget", keys=None, expected="an int",
                       accepts=lambda v: isinstance(v, int), accepts_key=lambda k: isinstance(k, str),
                       expected_key="keys must be str")
    yield made, gadgets
    ALL.remove(made)
    ALL.remove(gadgets)


def test_entries_name_the_plugin_and_not_found_lists_what_exists(widgets):
    made, _ = widgets
    plugins.manager().register(_plugin("p1", spmd_widgets=[Widget("b"), Widget("a")]), name="p1")
    assert made.keys() == ["a", "b"] and made.get("a").plugin == "p1"
    with pytest.raises(spmd.NotProvidedError, match=r"^unknown widget 'c'; available widgets: a, b\. Install a widget plugin$"):
        made.get("c")


def test_two_plugins_with_one_key_conflict_naming_both(widgets):
    made, _ = widgets
    pm = plugins.manager()
    pm.register(_plugin("p1", spmd_widgets=[Widget("a")]), name="p1")
    pm.register(_plugin("p2", spmd_widgets=[Widget("a")]), name="p2")
    with pytest.raises(spmd.PluginConflictError, match=r"widget 'a' is provided by two plugins: 'p[12]' and 'p[12]' \(neither"):
        made.entries()


@pytest.mark.parametrize("overrider_first", [True, False])
def test_the_overriding_entry_wins_in_either_order_and_two_overriders_conflict(widgets, overrider_first):
    made, _ = widgets
    pm = plugins.manager()
    plain = _plugin("plain", spmd_widgets=[Widget("a")])
    better = _plugin("better", spmd_widgets=[Widget("a", overrides=True)])
    for module in ((better, plain) if overrider_first else (plain, better)):
        pm.register(module, name=module.__name__)
    assert made.get("a").plugin == "better" and made.get("a").overrides
    pm.register(_plugin("also", spmd_widgets=[Widget("a", overrides=True)]), name="also")
    with pytest.raises(spmd.PluginConflictError, match="both declare overrides"):
        made.entries()


def test_a_mapping_hook_declares_overrides_with_overriding(widgets):
    _, gadgets = widgets
    pm = plugins.manager()
    pm.register(_plugin("base", spmd_gadgets={"x": 1, "y": 2}), name="base")
    pm.register(_plugin("patch", spmd_gadgets={"x": spmd.Overriding(10)}), name="patch")
    assert {k: (e.spec, e.plugin) for k, e in gadgets.entries().items()} == {"x": (10, "patch"), "y": (2, "base")}


def test_a_wrong_spec_or_key_is_a_named_error(widgets):
    made, gadgets = widgets
    pm = plugins.manager()
    pm.register(_plugin("bad", spmd_widgets=[object()], spmd_gadgets={3: 1}), name="bad")
    with pytest.raises(spmd.PluginSpecError, match="plugin 'bad' returned <object object at .*> from spmd_widgets\\(\\); expected a Widget"):
        made.entries()
    with pytest.raises(spmd.PluginSpecError, match="plugin 'bad' returned a gadget for 3 from spmd_gadgets\\(\\); keys must be str"):
        gadgets.entries()


def test_the_table_and_its_memo_follow_the_generation(widgets):
    made, _ = widgets
    pm = plugins.manager()
    pm.register(_plugin("p1", spmd_widgets=[Widget("a")]), name="p1")
    table = made.table()
    table.memo["derived"] = "from p1"
    assert made.table() is table  # read again without a new generation: the same table
    late = _plugin("late", spmd_widgets=[Widget("b")])
    pm.register(late, name="late")
    assert made.table() is not table and "derived" not in made.table().memo
    assert made.keys() == ["a", "b"]
    pm.unregister(late)
    assert made.keys() == ["a"]


# -- rules and communication hooks through it ----------------------------------------------------------------


def _rule_plugin(rule):
    module = types.ModuleType("mm_rules")
    module.spmd_sharding_rules = spmd.hookimpl(lambda: {torch.ops.aten.mm.default: rule})
    return module


def test_a_rule_plugin_overrides_one_builtin_rule_and_leaves_the_others():
    from spmd.tensor import registry
    from spmd.tensor.rule import replicate_rule

    builtin_mm, builtin_add = registry.lookup(torch.ops.aten.mm.default), registry.lookup(torch.ops.aten.add.Tensor)
    assert builtin_mm is not replicate_rule and registry.owner(torch.ops.aten.mm.default) == "spmd.tensor.rules"
    pm = plugins.manager()
    pm.register(_rule_plugin(replicate_rule), name="plain-mm")
    with pytest.raises(spmd.PluginConflictError, match="sharding rule aten.mm.default is provided by two plugins: '(plain-mm|spmd.tensor.rules)' and '(plain-mm|spmd.tensor.rules)'.*spmd.Overriding"):
        registry.lookup(torch.ops.aten.mm.default)
    pm.unregister(name="plain-mm")
    pm.register(_rule_plugin(spmd.Overriding(replicate_rule)), name="my-mm")
    assert registry.lookup(torch.ops.aten.mm.default) is replicate_rule
    assert registry.owner(torch.ops.aten.mm.default) == "my-mm"
    assert registry.lookup(torch.ops.aten.add.Tensor) is builtin_add
    pm.unregister(name="my-mm")
    assert registry.lookup(torch.ops.aten.mm.default) is builtin_mm


def test_register_comm_hook_is_a_plugin_and_a_second_name_needs_override():
    from spmd.parallel import comm_hooks

    def mine(state, bucket):
        return comm_hooks.allreduce_hook(state, bucket)

    try:
        comm_hooks.register_hook("test_registry_hook", mine)
        plugins.reset()  # a plugin module registers at its import, once: what it added outlives a reload
        comm_hooks.register_hook("test_registry_hook", mine)  # the same function again: fine
        assert comm_hooks.get_hook("test_registry_hook") is mine
        assert comm_hooks.COMM_HOOKS.get("test_registry_hook").plugin == "comm-hook:test_registry_hook"
        with pytest.raises(spmd.PluginConflictError, match="'test_registry_hook' is registered twice"):
            comm_hooks.register_hook("test_registry_hook", comm_hooks.fp16_compress_hook)
        comm_hooks.register_hook("allreduce", mine, override=True)  # wins over the builtin plugin's
        assert comm_hooks.get_hook("allreduce") is mine
        with pytest.raises(spmd.NotProvidedError, match="unknown communication hook 'nope'; registered hooks: allreduce, bf16, .*test_registry_hook"):
            comm_hooks.get_hook("nope")
    finally:
        for name in ("test_registry_hook", "allreduce"):
            plugins._added.pop(f"comm-hook:{name}", None)
        plugins.reset()
    assert comm_hooks.get_hook("allreduce") is comm_hooks.allreduce_hook


def test_a_plugin_module_that_registers_a_comm_hook_at_its_import_loads(tmp_path, monkeypatch):
    """register_hook called while the manager is loading the module (from the loading thread) neither blocks
    nor is lost: the hook is found, and again after a reset (the module is not imported twice)."""

    from spmd.parallel import comm_hooks

    (tmp_path / "hooky_plugin.py").write_text(
        "from spmd.parallel.comm_hooks import allreduce_hook, register_hook\n"
        "register_hook('hooky', allreduce_hook)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    add_entry_point(monkeypatch, "hooky", "hooky_plugin")
    try:
        assert comm_hooks.get_hook("hooky") is comm_hooks.allreduce_hook
        assert plugins.manager().infos["hooky"].loaded
        plugins.reset()
        assert comm_hooks.get_hook("hooky") is comm_hooks.allreduce_hook
    finally:
        plugins._added.pop("comm-hook:hooky", None)
