"""The registry of backends that the plugins declared (rebuilt when the plugins change), and backend-string parsing."""

from __future__ import annotations

import importlib.metadata
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from spmd.comm.backend import BackendSpec
from spmd.errors import BackendNotFoundError, BackendUnavailableError, PluginConflictError

if TYPE_CHECKING:
    from spmd.plugins import HookTable


@dataclass(frozen=True)
class RegisteredBackend:
    """A BackendSpec and the plugin that provided it."""

    spec: BackendSpec
    plugin: str


class BackendRegistry:
    """Name -> backend, built once from every plugin's ``spmd_backends`` hook."""

    def __init__(self, entries: Mapping[str, RegisteredBackend], broken: Mapping[str, str]) -> None:
        self._entries = dict(entries)
        self._broken = dict(broken)  # plugin name -> error, for "why is X missing"

    def names(self) -> list[str]:
        return sorted(self._entries)

    def entries(self) -> list[RegisteredBackend]:
        return [self._entries[n] for n in self.names()]

    def get(self, name: str) -> RegisteredBackend:
        """The backend called ``name``, or an error that lists what is installed and how to get it."""
        entry = self._entries.get(name)
        if entry is not None:
            return entry
        installed = ", ".join(self.names()) or "none"
        hints = []
        if name in self._broken:
            hints.append(f"plugin {name!r} is installed but failed to load: {self._broken[name]}")
        if name in _kernel_extras():
            hints.append(f"install it with: pip install 'spmd[{name}]' (or pip install -e plugins/{name})")
        else:
            hints.append("install the plugin distribution that provides it, then check with `spmd plugins`")
        raise BackendNotFoundError(
            f"unknown backend {name!r}; installed backends: {installed}. " + "; ".join(hints)
        )

    def for_device(self, device_type: str) -> RegisteredBackend:
        """The highest-priority usable backend for ``device_type`` (what ``spmd.init()`` picks)."""
        candidates = sorted(
            (e for e in self._entries.values() if device_type in e.spec.devices),
            key=lambda e: (-e.spec.priority, e.spec.name),
        )
        reasons = []
        for entry in candidates:
            reason = entry.spec.unavailable_reason()
            if reason is None:
                return entry
            reasons.append(f"{entry.spec.name}: {reason}")
        detail = "; ".join(reasons) if reasons else f"no installed backend supports {device_type!r}"
        raise BackendUnavailableError(
            f"no usable backend for device {device_type!r} ({detail}); run `spmd doctor` for details"
        )

    def device_types(self) -> list[str]:
        return sorted({d for e in self._entries.values() for d in e.spec.devices})


def _kernel_extras() -> set[str]:
    try:
        extras = importlib.metadata.metadata("spmd").get_all("Provides-Extra") or []
    except importlib.metadata.PackageNotFoundError:
        return set()
    return set(extras) - {"all", "dev"}


def build_registry() -> BackendRegistry:
    """Collect BackendSpecs from every plugin; a duplicate name is an error naming both plugins."""
    from spmd.plugins import manager

    pm = manager()
    entries: dict[str, RegisteredBackend] = {}
    for plugin, specs in pm.hook_results("spmd_backends"):
        for spec in specs:
            if not isinstance(spec, BackendSpec):
                raise TypeError(f"plugin {plugin!r} returned {spec!r} from spmd_backends; expected spmd.BackendSpec")
            previous = entries.get(spec.name)
            if previous is not None and not (spec.overrides or previous.spec.overrides):
                raise PluginConflictError(
                    f"backend {spec.name!r} is provided by two plugins: {previous.plugin!r} and "
                    f"{plugin!r}. Uninstall one, block one with SPMD_BLOCK_PLUGINS={plugin}, or "
                    "declare overrides=True in the BackendSpec that should win"
                )
            if previous is not None and previous.spec.overrides and not spec.overrides:
                continue
            entries[spec.name] = RegisteredBackend(spec, plugin)
    broken = {name: info.error for name, info in pm.infos.items() if info.error}
    return BackendRegistry(entries, broken)


_table: HookTable[BackendRegistry] | None = None
_lock = threading.Lock()


def backends() -> BackendRegistry:
    """The backend registry: built on first use, and again after a plugin is registered at runtime
    (``spmd.plugins.manager().register(plugin)``), as the other registries are."""
    global _table
    if _table is None:
        from spmd.plugins import HookTable

        with _lock:
            if _table is None:
                _table = HookTable(lambda pm: build_registry())
    return _table.get()


def reset() -> None:
    if _table is not None:
        _table.reset()


def parse_backend_string(backend: str | Mapping[str, str] | None) -> dict[str, str] | None:
    """``"gloo"`` / ``"cpu:gloo,cuda:nccl"`` / ``{"cpu": "gloo"}`` -> {device: name}; None stays None.

    A bare name maps every device type that backend declares.
    """
    if backend is None:
        return None
    if isinstance(backend, Mapping):
        return {str(k): str(v) for k, v in backend.items()}
    backend = backend.strip()
    if ":" not in backend:
        spec = backends().get(backend.lower()).spec
        return {device: spec.name for device in spec.devices}
    mapping: dict[str, str] = {}
    for part in backend.split(","):
        device, sep, name = part.partition(":")
        if not sep or not device.strip() or not name.strip():
            raise ValueError(
                f"bad backend string {backend!r}: write 'name' or 'device:name,device:name', "
                "e.g. 'cpu:gloo,cuda:nccl'"
            )
        mapping[device.strip()] = name.strip().lower()
    return mapping
