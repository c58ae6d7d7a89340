"""The plugin manager: builtins first, then the entry-point group ``spmd``, loaded once.

Environment switches:

``SPMD_DISABLE_PLUGIN_AUTOLOAD=1``
    load only the builtin plugins (and those named in ``SPMD_PLUGINS``).
``SPMD_PLUGINS=name,name``
    with autoload disabled, the entry-point plugins to load anyway.
``SPMD_BLOCK_PLUGINS=name,name``
    never load these plugins (entry-point names or builtin module names).

A plugin that fails to import or whose hooks do not match the specs is
reported (name, distribution, error) with a warning and left out; everything
else keeps working.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import threading
import traceback
import warnings
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pluggy

from spmd import hookspecs, settings
from spmd.markers import PROJECT

ENTRY_POINT_GROUP = "spmd"
ENV_DISABLE_AUTOLOAD = "SPMD_DISABLE_PLUGIN_AUTOLOAD"
ENV_ENABLE = "SPMD_PLUGINS"
ENV_BLOCK = "SPMD_BLOCK_PLUGINS"

#: Builtin plugins, registered before any entry point (the way pytest ships its features).
BUILTIN_PLUGINS = (
    "spmd.launch.environments",
    "spmd.launch.c10d_rendezvous",
    "spmd.launch.etcd_rendezvous",
    "spmd.parallel.builtin",
    "spmd.pipeline.builtin",
    "spmd.tensor.rules",
    "spmd.checkpoint.filesystem",
    "spmd.checkpoint.fsspec_storage",
)


R = TypeVar("R")


@dataclass
class PluginInfo:
    """What ``spmd plugins`` and ``spmd doctor`` report about one plugin."""

    name: str
    distribution: str
    version: str
    module: str
    builtin: bool
    error: str | None = None
    blocked: bool = False
    provides: dict[str, list[str]] = field(default_factory=dict)

    @property
    def loaded(self) -> bool:
        return self.error is None and not self.blocked


class PluginManager(pluggy.PluginManager):
    """pluggy's manager plus the load report for every plugin, broken ones included.

    ``results(hookspecs.spmd_x, **kwargs)`` calls a hook the way pluggy would
    (``tryfirst``/``trylast`` order, wrappers around the plain implementations,
    each implementation given only the arguments it declares, so a hook can grow
    an argument) but runs each ``HookImpl`` itself: it knows which plugin
    returned what, and a plugin whose implementation raises is reported broken
    and skipped instead of failing the whole call.
    """

    def __init__(self) -> None:
        super().__init__(PROJECT)
        self.add_hookspecs(hookspecs)
        self.infos: dict[str, PluginInfo] = {}

    def register(self, plugin: object, name: str | None = None) -> str | None:
        """pluggy's ``register``; every cache of hook results sees the new generation."""
        registered = super().register(plugin, name)
        if registered is not None:
            _changed()
        return registered

    def unregister(self, plugin: object | None = None, name: str | None = None) -> Any:
        """pluggy's ``unregister``; every cache of hook results forgets what the plugin gave."""
        removed = super().unregister(plugin, name)
        _changed()
        return removed

    def results(self, spec: Callable[..., R], **kwargs: Any) -> list[tuple[str, R]]:
        """Call the hook that ``spec`` (a function of ``spmd.hookspecs``) specifies: (plugin, result) per non-None result.

        The order is pluggy's (``tryfirst`` first, then the most recently
        registered plugin first, ``trylast`` last). A result that only a wrapper
        put in the list is attributed to ``"?"``.
        """
        return _call(self, spec.__name__, kwargs)

    def hook_names(self) -> list[str]:
        """The names of every hook with a specification (the live registry, not a hand-kept list)."""
        return sorted(name for name, caller in vars(self.hook).items() if isinstance(caller, pluggy.HookCaller) and caller.spec is not None)

    def _mark_broken(self, name: str, message: str) -> None:
        info = self.infos.get(name)
        if info is not None and info.error is None:
            info.error = message
        warnings.warn(f"spmd plugin {name!r} is broken and was skipped: {message}", stacklevel=4)


def _call(pm: PluginManager, hook_name: str, kwargs: dict[str, Any]) -> list[tuple[str, Any]]:
    """Run every implementation of one hook in pluggy's order; an implementation that raises marks its plugin broken."""
    ordered = list(reversed(getattr(pm.hook, hook_name).get_hookimpls()))  # wrappers outermost-first, then plain ones
    started: list[tuple[pluggy.HookImpl, Generator[Any, Any, Any]]] = []
    record: list[tuple[str, Any]] = []
    for impl in ordered:
        try:
            value = impl.function(*[kwargs[name] for name in impl.argnames])
            if impl.wrapper or impl.hookwrapper:
                next(value)  # runs the wrapper up to its yield
                started.append((impl, value))
            elif value is not None:
                record.append((impl.plugin_name, value))
        except Exception as error:  # noqa: BLE001 - reported, not fatal
            pm._mark_broken(impl.plugin_name, f"{hook_name}() {_role(impl)}raised {type(error).__name__}: {error}")
    results = [value for _, value in record]
    for impl, wrapper in reversed(started):  # the innermost wrapper sees the results first
        try:
            results = _finish_wrapper(impl, wrapper, results)
        except Exception as error:  # noqa: BLE001 - reported, not fatal: the results stay as they were
            pm._mark_broken(impl.plugin_name, f"{hook_name}() wrapper raised {type(error).__name__}: {error}")
    if len(results) == len(record) and all(value is mine for value, (_, mine) in zip(results, record)):
        return record
    owners = {id(value): plugin for plugin, value in record}
    return [(owners.get(id(value), "?"), value) for value in results if value is not None]


def _finish_wrapper(impl: pluggy.HookImpl, wrapper: Generator[Any, Any, Any], results: list[Any]) -> list[Any]:
    """Send ``results`` into a wrapper paused at its yield; what it returns (new style) or forces (old style)."""
    if impl.hookwrapper:  # old style: it receives a pluggy.Result and may force another result
        outcome: pluggy.Result[list[Any]] = pluggy.Result(results, None)
        try:
            wrapper.send(outcome)
        except StopIteration:
            return outcome.get_result()
        raise RuntimeError("the hookwrapper yielded twice")
    try:
        wrapper.send(results)
    except StopIteration as stop:
        return list(stop.value)
    raise RuntimeError("the wrapper yielded twice")


def _role(impl: pluggy.HookImpl) -> str:
    return "wrapper " if impl.wrapper or impl.hookwrapper else ""


def _register(pm: PluginManager, info: PluginInfo, load: Callable[[], object]) -> None:
    pm.infos[info.name] = info
    if info.blocked:
        return
    try:
        module = load()
        pm.register(module, name=info.name)
        pm.check_pending()
    except Exception as error:  # noqa: BLE001 - a broken plugin must not break the rest
        if pm.get_plugin(info.name) is not None:
            pm.unregister(name=info.name)
        detail = traceback.format_exception_only(type(error), error)[-1].strip()
        info.error = detail
        warnings.warn(
            f"spmd plugin {info.name!r} (distribution {info.distribution} {info.version}) "
            f"failed to load and was skipped: {detail}",
            stacklevel=3,
        )


def _load_all(pm: PluginManager) -> PluginManager:
    read = settings.refresh()  # building the manager is an entry point: variables set since import count
    blocked = read.block_plugins
    kernel_version = importlib.metadata.version("spmd") if _has_dist("spmd") else "dev"
    for module_name in BUILTIN_PLUGINS:
        info = PluginInfo(
            name=module_name,
            distribution="spmd",
            version=kernel_version,
            module=module_name,
            builtin=True,
            blocked=module_name in blocked,
        )
        _register(pm, info, functools.partial(importlib.import_module, module_name))

    autoload = not read.disable_plugin_autoload
    enabled = read.plugins
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if not autoload and ep.name not in enabled:
            continue
        dist = ep.dist
        info = PluginInfo(
            name=ep.name,
            distribution=dist.metadata["Name"] if dist else "?",
            version=dist.version if dist else "?",
            module=ep.value,
            builtin=False,
            blocked=ep.name in blocked,
        )
        if ep.name in pm.infos:
            continue  # one distribution installed twice on the path; the first wins
        _register(pm, info, ep.load)
    for name, plugin in list(_added.items()):
        if pm.get_plugin(name) is None:  # (one a plugin module added at its import here is in already)
            _register_added(pm, name, plugin)
    return pm


def _has_dist(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


_manager: PluginManager | None = None
#: The manager being loaded (set while ``_load_all`` runs): a plugin module that adds a plugin at its import
#: (``add``) reaches it from the loading thread, which holds ``_lock``.
_loading: PluginManager | None = None
_lock = threading.RLock()
#: Plugins that code added at run time (``add``), by name: registered into every manager, this one and any loaded
#: after a ``reset()`` (a module imported once would otherwise lose what it added at its import).
_added: dict[str, object] = {}

#: A token that changes whenever the set of plugins does (loaded, reset, registered or unregistered at
#: run time): every cache of what the hooks returned compares it by identity, one attribute read per use.
generation: object = object()


def _changed() -> None:
    global generation
    generation = object()


def manager() -> PluginManager:
    """The loaded PluginManager: builtins, then entry points. Loads lazily, once per process."""
    global _manager, _loading
    if _manager is None:
        with _lock:
            if _loading is not None:  # a plugin being loaded asks (from this thread: the lock is held)
                return _loading
            if _manager is None:
                _loading = PluginManager()
                try:
                    _manager = _load_all(_loading)
                finally:
                    _loading = None
    return _manager


def add(plugin: object, name: str) -> None:
    """Register ``plugin`` as ``name`` now and in every manager loaded later; a plugin added before under
    ``name`` is replaced. For code that provides hooks at run time (``register_comm_hook`` names a hook so)."""
    with _lock:
        _added[name] = plugin
        pm = _loading or _manager
        if pm is not None:
            if pm.get_plugin(name) is not None:
                pm.unregister(name=name)
            _register_added(pm, name, plugin)


def _register_added(pm: PluginManager, name: str, plugin: object) -> None:
    module = getattr(plugin, "__module__", None) or getattr(plugin, "__name__", "?")
    info = PluginInfo(name=name, distribution="(added at run time)", version="-", module=str(module), builtin=False)
    _register(pm, info, lambda: plugin)


def reset() -> None:
    """Forget the loaded plugins (tests, or after installing a plugin): every registry rebuilds on next use.

    Plugins added with ``add`` are registered again into the next manager."""
    global _manager
    with _lock:
        _manager = None
        _changed()
