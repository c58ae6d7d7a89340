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
import os
import threading
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

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
    """pluggy's manager plus the load report for every plugin, broken ones included."""

    def __init__(self) -> None:
        super().__init__(PROJECT)
        self.add_hookspecs(hookspecs)
        self.infos: dict[str, PluginInfo] = {}

    def hook_results(self, hook_name: str) -> Iterator[tuple[str, Any]]:
        """Call one hook on every plugin and yield (plugin name, result), skipping failures.

        A plugin whose hook raises is marked broken in ``infos`` and skipped.
        """
        caller = getattr(self.hook, hook_name)
        for impl in reversed(caller.get_hookimpls()):  # registration order
            try:
                result = impl.function()
            except Exception as error:  # noqa: BLE001 - reported, not fatal
                self._mark_broken(impl.plugin_name, f"{hook_name}() raised {type(error).__name__}: {error}")
                continue
            if result is not None:
                yield impl.plugin_name, result

    def _mark_broken(self, name: str, message: str) -> None:
        info = self.infos.get(name)
        if info is not None and info.error is None:
            info.error = message
        warnings.warn(f"spmd plugin {name!r} is broken and was skipped: {message}", stacklevel=3)


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


def manager() -> PluginManager:
    """The loaded PluginManager: builtins, then entry points. Loads lazily, once per process."""
    global _manager
    if _manager is None:
        with _lock:
            if _manager is None:
                _manager = _load_all()
    return _manager


def reset() -> None:
    """Forget the loaded plugins and registries (tests, or after installing a plugin)."""
    global _manager
    from spmd.checkpoint import storage as checkpoint_storage
    from spmd.comm import registry

    with _lock:
        _manager = None
    registry.reset()
    checkpoint_storage.reset()
