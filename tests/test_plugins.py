"""The plugin manager: builtins, entry points, broken plugins, conflicts, environment switches."""

import importlib.metadata
import sys
import types

import pytest

import spmd
from spmd import plugins
from spmd.comm import registry


@pytest.fixture(autouse=True)
def fresh_manager(monkeypatch):
    for var in (plugins.ENV_BLOCK, plugins.ENV_DISABLE_AUTOLOAD, plugins.ENV_ENABLE):
        monkeypatch.delenv(var, raising=False)
    plugins.reset()
    yield
    plugins.reset()


def test_manager_loads_builtins_then_entry_points_once():
    pm = plugins.manager()
    assert pm is plugins.manager()
    names = list(pm.infos)
    assert names[0] == "spmd.launch.environments"
    assert "gloo" in names
    assert pm.infos["gloo"].distribution == "spmd-gloo"
    assert pm.infos["gloo"].loaded


def add_entry_point(monkeypatch, name: str, module: str) -> None:
    """Make the installed distributions seem to declare one more ``spmd`` entry point, ``name = module``."""
    real = importlib.metadata.entry_points

    def with_one_more(**kwargs):
        eps = list(real(**kwargs))
        if kwargs.get("group") == "spmd":
            eps.append(importlib.metadata.EntryPoint(name, module, "spmd"))
        return eps

    monkeypatch.setattr(importlib.metadata, "entry_points", with_one_more)


def test_broken_plugin_is_reported_and_the_rest_keeps_working(monkeypatch):
    add_entry_point(monkeypatch, "broken", "spmd_no_such_module")
    with pytest.warns(UserWarning, match="'broken'.*failed to load"):
        pm = plugins.manager()
    assert not pm.infos["broken"].loaded
    assert "spmd_no_such_module" in pm.infos["broken"].error
    assert "gloo" in registry.backends().names()
    with pytest.raises(spmd.BackendNotFoundError, match="'broken' is installed but failed to load"):
        registry.backends().get("broken")


def _fake_plugin(name, backend_name, overrides=False):
    module = types.ModuleType(name)

    @spmd.hookimpl
    def spmd_backends():
        return [spmd.BackendSpec(backend_name, ("cpu",), factory=lambda ctx: None, overrides=overrides)]

    module.spmd_backends = spmd_backends
    return module


def test_two_plugins_with_one_backend_name_fail_naming_both():
    pm = plugins.manager()
    pm.register(_fake_plugin("impostor", "gloo"), name="impostor")
    with pytest.raises(spmd.PluginConflictError, match="'gloo'.*'impostor'"):
        registry.build_registry()


def test_override_wins_without_conflict():
    pm = plugins.manager()
    pm.register(_fake_plugin("better", "gloo", overrides=True), name="better")
    assert registry.build_registry().get("gloo").plugin == "better"


def test_disable_autoload_keeps_only_builtins(monkeypatch):
    monkeypatch.setenv(plugins.ENV_DISABLE_AUTOLOAD, "1")
    pm = plugins.manager()
    assert all(info.builtin for info in pm.infos.values())
    with pytest.raises(spmd.BackendNotFoundError, match="installed backends: none"):
        registry.backends().get("gloo")


def test_disable_autoload_with_explicit_enable(monkeypatch):
    monkeypatch.setenv(plugins.ENV_DISABLE_AUTOLOAD, "1")
    monkeypatch.setenv(plugins.ENV_ENABLE, "gloo")
    assert registry.backends().names() == ["gloo"]


def test_block_named_plugin(monkeypatch):
    monkeypatch.setenv(plugins.ENV_BLOCK, "gloo")
    pm = plugins.manager()
    assert pm.infos["gloo"].blocked
    assert "gloo" not in registry.backends().names()


def test_unknown_backend_lists_installed_and_extra(monkeypatch):
    """A backend whose plugin is not installed: the error lists what is, and the pip extra that provides it.

    The plugin is uninstalled for the test (its entry point hidden), so this
    runs wherever it is installed too, CI included.
    """
    real = importlib.metadata.entry_points

    def without_ucc(**kwargs):
        eps = real(**kwargs)
        return [ep for ep in eps if ep.name != "ucc"] if kwargs.get("group") == "spmd" else eps

    monkeypatch.setattr(importlib.metadata, "entry_points", without_ucc)
    assert "ucc" not in registry.backends().names()
    with pytest.raises(spmd.BackendNotFoundError) as info:
        registry.backends().get("ucc")
    message = str(info.value)
    assert "unknown backend 'ucc'; installed backends: " in message and "gloo" in message
    assert "pip install 'spmd[ucc]'" in message


def test_every_live_hook_is_documented_with_its_arguments():
    """Walks the hooks pluggy knows (names and argument names), not a hand-kept list.

    Each hook's docstring says ``Signature: ``name(args) -> ...`` `` and when it
    is called, and docs/hooks.md has a section headed by the same signature.
    """
    import pathlib
    import re

    pm = plugins.manager()
    names = pm.hook_names()
    assert "spmd_backends" in names and "spmd_strategies" in names
    docs = (pathlib.Path(__file__).parents[1] / "docs" / "hooks.md").read_text()
    for name in names:
        spec = getattr(pm.hook, name).spec
        call = f"{name}({', '.join(spec.argnames)})"
        doc = spec.function.__doc__ or ""
        assert f"Signature: ``{call} ->" in doc, f"{name}: docstring must say Signature: ``{call} -> ...``"
        assert "Called:" in doc, name
        assert re.search(rf"^## `{re.escape(call)}", docs, re.M), f"docs/hooks.md has no section '## `{call}`'"
    documented = set(re.findall(r"^## `(spmd_\w+)\(", docs, re.M))
    assert documented == set(names), "docs/hooks.md documents hooks that no longer exist"


def _grown_spec_module():
    """A spec module whose hook gained an argument (``options``) after plugins were written."""
    module = types.ModuleType("grown_specs")

    @spmd.hookspec
    def spmd_grown(options):
        """Signature: ``spmd_grown(options) -> object``."""

    module.spmd_grown = spmd_grown
    return module


def _impl_plugin(name, function, **marks):
    module = types.ModuleType(name)
    module.spmd_grown = spmd.hookimpl(**marks)(function) if marks else spmd.hookimpl(function)
    return module


def test_a_hook_that_gains_an_argument_still_calls_old_implementations():
    pm = plugins.manager()
    specs = _grown_spec_module()
    pm.add_hookspecs(specs)

    def old():  # written before the hook had ``options``
        return "old"

    def new(options):
        return f"new {options['x']}"

    pm.register(_impl_plugin("old_plugin", old), name="old_plugin")
    pm.register(_impl_plugin("new_plugin", new), name="new_plugin")
    results = dict(pm.results(specs.spmd_grown, options={"x": 1}))
    assert results == {"old_plugin": "old", "new_plugin": "new 1"}


def test_hook_calls_honour_tryfirst_trylast_and_wrappers():
    pm = plugins.manager()
    specs = _grown_spec_module()
    pm.add_hookspecs(specs)
    pm.register(_impl_plugin("last", lambda: "last", trylast=True), name="last")
    pm.register(_impl_plugin("first", lambda: "first", tryfirst=True), name="first")
    pm.register(_impl_plugin("middle", lambda: "middle"), name="middle")

    def wrap(options):
        results = yield
        return [*results, f"wrapped {options}"]

    pm.register(_impl_plugin("wrapper", wrap, wrapper=True), name="wrapper")
    assert pm.results(specs.spmd_grown, options=7) == [
        ("first", "first"),
        ("middle", "middle"),
        ("last", "last"),
        ("?", "wrapped 7"),  # a result only a wrapper made has no plugin of its own
    ]


def test_a_hook_that_raises_marks_its_plugin_broken_and_the_others_still_answer():
    pm = plugins.manager()
    pm.register(_fake_plugin("fine", "fine_backend"), name="fine")
    module = types.ModuleType("raiser")

    @spmd.hookimpl
    def spmd_backends():
        raise RuntimeError("boom")

    module.spmd_backends = spmd_backends
    pm.register(module, name="raiser")
    pm.infos["raiser"] = plugins.PluginInfo("raiser", "raiser-dist", "1", "raiser", builtin=False)
    with pytest.warns(UserWarning, match="'raiser' is broken.*spmd_backends\\(\\) raised RuntimeError: boom"):
        names = registry.build_registry().names()
    assert "fine_backend" in names and "gloo" in names
    assert "boom" in pm.infos["raiser"].error


def test_a_wrapper_that_raises_is_skipped_and_the_results_stay_as_they_were():
    pm = plugins.manager()
    specs = _grown_spec_module()
    pm.add_hookspecs(specs)
    pm.register(_impl_plugin("plain", lambda: "plain"), name="plain")

    def bad_wrapper():
        yield
        raise RuntimeError("wrapper boom")

    pm.register(_impl_plugin("badwrap", bad_wrapper, wrapper=True), name="badwrap")
    with pytest.warns(UserWarning, match="'badwrap' is broken"):
        assert pm.results(specs.spmd_grown, options=None) == [("plain", "plain")]


def test_kernel_names_no_concrete_backend():
    """The kernel chooses by declared devices and priorities, never by backend name.

    Identifiers and bare string literals such as ``"gloo"`` count; examples in
    docstrings and error messages ("e.g. 'cpu:gloo,cuda:nccl'") do not.
    """
    import io
    import pathlib
    import tokenize

    vendors = {"gloo", "nccl", "mpi", "mpi4py", "ucc", "ucx", "ucxx", "cuda_nccl"}
    root = pathlib.Path(spmd.__file__).parent
    offenders = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if rel.parts[0] in ("testing", "launch"):  # test kit and launcher environments
            continue
        for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            text = tok.string.lower()
            if tok.type == tokenize.NAME and text in vendors:
                offenders.append(f"{rel}:{tok.start[0]}: identifier {tok.string}")
            if tok.type == tokenize.STRING and text.strip("\"'bfru") in vendors:
                offenders.append(f"{rel}:{tok.start[0]}: literal {tok.string}")
    assert not offenders, "\n".join(offenders)


def test_plugins_command_lists_distribution_version_and_provides():
    import subprocess

    out = subprocess.run([sys.executable, "-m", "spmd", "plugins"], capture_output=True, text=True, check=True).stdout
    assert "gloo  [plugin] spmd-gloo 0.1.0  loaded" in out
    assert "backends: gloo (cpu)" in out


def test_doctor_shows_usability_and_native_ops():
    import subprocess

    out = subprocess.run([sys.executable, "-m", "spmd", "doctor"], capture_output=True, text=True, check=True).stdout
    assert "+ gloo [cpu]" in out and "usable" in out
    assert "native: all_gather_into_tensor, all_reduce" in out


def _kernel_private_uses(package_dir):
    """Where a plugin touches the kernel's private names: Work subclasses, its underscore
    attributes (unless the plugin's own class defines that name), ``from spmd... import _x``."""
    import ast
    import pathlib

    from spmd.comm.backend import Backend
    from spmd.comm.work import NativeWorkAdapter, Work

    private = {n for cls in (Work, NativeWorkAdapter, Backend) for c in cls.__mro__ for n in vars(c)
               if n.startswith("_") and not n.startswith("__") and n != "_abc_impl"}
    found = []
    for path in sorted(pathlib.Path(package_dir).rglob("*.py")):
        tree = ast.parse(path.read_text())
        own = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in ast.walk(node):
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        own.add(item.name)
                    elif isinstance(item, (ast.AnnAssign, ast.Assign)):
                        targets = [item.target] if isinstance(item, ast.AnnAssign) else item.targets
                        own |= {t.id for t in targets if isinstance(t, ast.Name)}
                        own |= {t.attr for t in targets if isinstance(t, ast.Attribute)}
        for node in ast.walk(tree):
            where = f"{path.name}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.ClassDef) and any(getattr(b, "id", getattr(b, "attr", "")) == "Work" for b in node.bases):
                found.append(f"{where}: class {node.name} subclasses spmd's Work")
            elif isinstance(node, ast.Attribute) and node.attr in private and node.attr not in own:
                found.append(f"{where}: .{node.attr}")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("spmd."):
                found += [f"{where}: imports {a.name} from {node.module}" for a in node.names if a.name.startswith("_")]
    return found


@pytest.mark.parametrize("plugin", ["gloo", "mpi", "ucc", "nccl", "plugin-p2p"])
def test_plugins_use_only_the_kernels_public_names(plugin):
    """Backends complete through the NativeWork protocol (or Work.completed/from_future), never
    through Work's private state: a plugin that reaches into the kernel breaks when it changes."""
    import pathlib

    root = pathlib.Path(__file__).parents[1]
    folder = root / "examples" / plugin if plugin == "plugin-p2p" else root / "plugins" / plugin
    package = next(p for p in folder.iterdir() if p.is_dir() and p.name.startswith("spmd_"))
    uses = _kernel_private_uses(package)
    assert not uses, f"spmd-{plugin} uses the kernel's private names:\n" + "\n".join(uses)
