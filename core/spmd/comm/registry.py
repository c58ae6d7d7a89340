"""The registry of backends that the plugins declared (rebuilt when the plugins change), and backend-string parsing."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Mapping
from typing import NamedTuple

from spmd import hookspecs
from spmd.comm.backend import BackendSpec
from spmd.errors import BackendNotFoundError, BackendUnavailableError
from spmd.registry import Entry, Registry

#: A BackendSpec and the plugin that provided it.
RegisteredBackend = Entry[str, BackendSpec]


def _install_hint(name: str) -> str:
    """Why ``name`` may be missing and how to get it: a plugin that failed to load, or the pip extra."""
    from spmd.plugins import manager

    hints = []
    info = manager().infos.get(name)
    if info is not None and info.error:
        hints.append(f"plugin {name!r} is installed but failed to load: {info.error}")
    if name in _kernel_extras():
        hints.append(f"install it with: pip install 'spmd[{name}]' (or pip install -e plugins/{name})")
    else:
        hints.append("install the plugin distribution that provides it, then check with `spmd plugins`")
    return "; ".join(hints)


BACKENDS: Registry[str, BackendSpec] = Registry(
    hookspecs.spmd_backends, "backend", BackendSpec, missing=BackendNotFoundError, listed="installed", hint=_install_hint)


class Choice(NamedTuple):
    """The kernel's own choice of a backend for one group and device type."""

    entry: RegisteredBackend
    #: The ``one_host`` backend ranked above ``entry`` that was passed over because the group spans hosts.
    passed_over: RegisteredBackend | None = None


class BackendRegistry:
    """Name -> backend over ``BACKENDS``, with the choice of a backend per device type."""

    def __init__(self, entries: Mapping[str, RegisteredBackend]) -> None:
        self._entries = entries

    def names(self) -> list[str]:
        return sorted(self._entries)

    def entries(self) -> list[RegisteredBackend]:
        return [self._entries[n] for n in self.names()]

    def get(self, name: str) -> RegisteredBackend:
        """The backend called ``name``, or an error that lists what is installed and how to get it."""
        entry = self._entries.get(name)
        if entry is None:
            raise BACKENDS.not_found(name)
        return entry

    def for_device(self, device_type: str, spans_hosts: Callable[[], bool] | None = None) -> RegisteredBackend:
        """The highest-priority usable backend for ``device_type`` (what ``spmd.init()`` picks).

        ``spans_hosts()`` tells whether the group runs on several hosts; it is
        asked only when a ``one_host`` backend comes first (None: one host).
        """
        return self.choose(device_type, spans_hosts).entry

    def choose(self, device_type: str, spans_hosts: Callable[[], bool] | None = None) -> Choice:
        """``for_device``'s pick, with the ``one_host`` backend it passed over because the group spans hosts
        (which a hierarchical all_reduce may still use inside each host, see ``spmd.comm.hierarchical``)."""
        candidates = sorted(
            (e for e in self._entries.values() if device_type in e.spec.devices),
            key=lambda e: (-e.spec.priority, e.spec.name),
        )
        reasons = []
        passed_over: RegisteredBackend | None = None
        for entry in candidates:
            reason = entry.spec.unavailable_reason()
            if reason is None and entry.spec.one_host and spans_hosts is not None and spans_hosts():
                reason = "it serves only groups whose ranks share one host, and this group spans several"
                passed_over = passed_over or entry
            if reason is None:
                return Choice(entry, passed_over)
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


def backends() -> BackendRegistry:
    """The backend registry: built on first use, and again after a plugin is registered at runtime
    (``spmd.plugins.manager().register(plugin)``), as the other registries are."""
    return BackendRegistry(BACKENDS.entries())


#: What tests call to collect afresh (the same as ``backends()``: every plugin change starts a new generation).
build_registry = backends


def reset() -> None:
    """Forget the collected backends (they are collected again on next use)."""
    BACKENDS.reset()


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
