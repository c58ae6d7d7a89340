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

import contextvars
import functools
import importlib
import importlib.metadata
import os
import threading
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Generic, TypeVar

import pluggy

from spmd import hookspecs
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

    Hooks are called through pluggy (``pm.hook.<name>(**kwargs)``), so
    ``tryfirst``/``trylast``, wrappers and implementations that accept fewer
    arguments than the spec all work: a hook can grow an argument and every
    older implementation keeps being called. ``hook_results`` adds what the
    registries need on top: which plugin returned what (recovered from pluggy's
    own ``HookImpl`` records), and a plugin whose implementation raises is
    reported as broken and skipped instead of failing the whole call.
    """

    def __init__(self) -> None:
        super().__init__(PROJECT)
        self.add_hookspecs(hookspecs)
        self.infos: dict[str, PluginInfo] = {}

    def register(self, plugin: object, name: str | None = None) -> str | None:
        """Register ``plugin`` (pluggy's ``register``), guarding its hook implementations.

        Each plain implementation is wrapped once, here, so that when it raises
        the plugin is reported broken and the call goes on without its result,
        and so that every result can be traced to the plugin that returned it.
        Wrappers (``wrapper=True``/``hookwrapper=True``) are left as they are.
        """
        registered = super().register(plugin, name)
        if registered is None:
            return None
        _changed()
        for caller in self.get_hookcallers(plugin) or ():
            for impl in caller.get_hookimpls():
                if impl.plugin is plugin and not (impl.wrapper or impl.hookwrapper):
                    # HookImpl.function is declared Final in pluggy's stubs; its argnames
                    # (computed from the original at registration) stay what pluggy passes.
                    setattr(impl, "function", _guarded(self, caller.name, impl.plugin_name, impl.function))  # noqa: B010
        return registered

    def unregister(self, plugin: object | None = None, name: str | None = None) -> Any:
        """pluggy's ``unregister``; every cache of hook results forgets what the plugin gave."""
        removed = super().unregister(plugin, name)
        _changed()
        return removed

    def call_hook(self, hook_name: str, **kwargs: Any) -> list[tuple[str, Any]]:
        """Call one hook through pluggy; return (plugin name, result) for every non-None result.

        The order is pluggy's call order (``tryfirst`` first, then the most
        recently registered plugin first, ``trylast`` last). Implementations
        receive only the keyword arguments they declare. A plugin whose
        implementation raises is marked broken in ``infos`` (with a warning)
        and left out; one whose wrapper raises is left out of a retried call.
        A result that a wrapper put in the list is attributed to ``"?"``.
        """
        excluded: list[object] = []
        while True:
            caller = self.subset_hook_caller(hook_name, excluded) if excluded else getattr(self.hook, hook_name)
            token = _CALL_RECORD.set([])
            try:
                results = caller(**kwargs)
                record = _CALL_RECORD.get()
            except Exception as error:
                culprit = _raising_wrapper(caller, error)
                if culprit is None:
                    raise
                self._mark_broken(culprit.plugin_name, f"{hook_name}() wrapper raised {type(error).__name__}: {error}")
                excluded.append(culprit.plugin)
                continue
            finally:
                _CALL_RECORD.reset(token)
            if len(record) == len(results) and all(r is result for (_, r), result in zip(record, results)):
                return record  # no wrapper changed the list: pluggy's results in call order
            owners = {id(result): plugin for plugin, result in record}
            return [(owners.get(id(result), "?"), result) for result in results if result is not None]

    def hook_results(self, hook_name: str, **kwargs: Any) -> Iterator[tuple[str, Any]]:
        """Iterate ``call_hook(hook_name, **kwargs)``: (plugin name, result), broken plugins skipped."""
        yield from self.call_hook(hook_name, **kwargs)

    def hook_names(self) -> list[str]:
        """The names of every hook with a specification (the live registry, not a hand-kept list)."""
        return sorted(name for name, caller in vars(self.hook).items() if isinstance(caller, pluggy.HookCaller) and caller.spec is not None)

    def _mark_broken(self, name: str, message: str) -> None:
        info = self.infos.get(name)
        if info is not None and info.error is None:
            info.error = message
        warnings.warn(f"spmd plugin {name!r} is broken and was skipped: {message}", stacklevel=4)


#: The (plugin name, result) pairs of the hook call in progress in this context (see ``call_hook``).
_CALL_RECORD: contextvars.ContextVar[list[tuple[str, Any]]] = contextvars.ContextVar("spmd_hook_call")


def _guarded(pm: PluginManager, hook_name: str, plugin_name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` that records its result for ``call_hook`` and turns an exception into "broken, skipped"."""

    @functools.wraps(function)  # pluggy reads the argument names through __wrapped__
    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            result = function(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - reported, not fatal
            pm._mark_broken(plugin_name, f"{hook_name}() raised {type(error).__name__}: {error}")
            return None
        if result is not None:
            record = _CALL_RECORD.get(None)
            if record is not None:
                record.append((plugin_name, result))
        return result

    return guarded


def _raising_wrapper(caller: pluggy.HookCaller, error: BaseException) -> pluggy.HookImpl | None:
    """The wrapper implementation in whose frame ``error`` was raised, if one was."""
    wrappers = {impl.function.__code__: impl for impl in caller.get_hookimpls() if (impl.wrapper or impl.hookwrapper) and hasattr(impl.function, "__code__")}
    tb = error.__traceback__
    found = None
    while tb is not None:
        impl = wrappers.get(tb.tb_frame.f_code)
        if impl is not None:
            found = impl
        tb = tb.tb_next
    return found


def _names(variable: str) -> set[str]:
    return {n.strip() for n in os.environ.get(variable, "").split(",") if n.strip()}


def _register(pm: PluginManager, info: PluginInfo, load: Callable[[], ModuleType]) -> None:
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


def _load_all() -> PluginManager:
    pm = PluginManager()
    blocked = _names(ENV_BLOCK)
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

    autoload = os.environ.get(ENV_DISABLE_AUTOLOAD, "").lower() not in ("1", "true", "yes")
    enabled = _names(ENV_ENABLE)
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
    return pm


def _has_dist(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


_manager: PluginManager | None = None
_lock = threading.Lock()

#: A token that changes whenever the set of plugins does (loaded, reset, registered or unregistered at
#: run time): every cache of what the hooks returned compares it by identity, one attribute read per use.
generation: object = object()


def _changed() -> None:
    global generation
    generation = object()


def manager() -> PluginManager:
    """The loaded PluginManager: builtins, then entry points. Loads lazily, once per process."""
    global _manager
    if _manager is None:
        with _lock:
            if _manager is None:
                _manager = _load_all()
    return _manager


T = TypeVar("T")


class HookTable(Generic[T]):
    """What ``build(pm)`` makes of the plugins' hook results, built once per set of plugins.

    The registries of strategies, schedules, storages and sharding rules each
    keep one: it is rebuilt when the plugin manager was reset or a plugin was
    registered at runtime (``pm.register``), and read without a lock otherwise.
    """

    def __init__(self, build: Callable[[PluginManager], T]) -> None:
        self._build = build
        self._cache: tuple[object, T] | None = None
        self._lock = threading.Lock()

    def get(self) -> T:
        pm = manager()
        key = generation
        cached = self._cache
        if cached is None or cached[0] is not key:
            with self._lock:
                cached = self._cache
                if cached is None or cached[0] is not key:
                    cached = self._cache = (key, self._build(pm))
        return cached[1]

    def reset(self) -> None:
        with self._lock:
            self._cache = None


def reset() -> None:
    """Forget the loaded plugins (tests, or after installing a plugin): every registry rebuilds on next use."""
    global _manager
    with _lock:
        _manager = None
        _changed()
