"""One registry for every hook that names things: collection, type checks, conflicts, overrides, not-found messages.

Each registry is a ``Registry(hook, ...)`` over one hook specification of
``spmd.hookspecs``. It calls the hook once per generation of the plugins
(``spmd.plugins.generation``: a plugin loaded, registered or unregistered at run
time starts a new one), checks what each plugin returned, and freezes it into
key -> ``Entry(key, spec, plugin)``. Two plugins giving one key is a
``PluginConflictError`` naming both, unless exactly one of them declares that it
overrides: a spec with ``overrides=True`` (or ``overrides = True`` on a class),
or a value wrapped as ``spmd.Overriding(value)`` in a mapping hook.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from spmd import plugins
from spmd.errors import NotProvidedError, PluginConflictError, PluginSpecError

K = TypeVar("K", bound=Hashable)
S = TypeVar("S")
V = TypeVar("V")

#: Every registry made, in order: what the test that walks the live registry reads.
ALL: list[Registry[Any, Any]] = []


@dataclass(frozen=True)
class Overriding(Generic[V]):
    """``value``, declared to win over another plugin's entry under the same key (for mapping hooks such as rules)."""

    value: V


@dataclass(frozen=True)
class Entry(Generic[K, S]):
    """One registered thing: its key, the spec (or rule, or hook) and the plugin that provided it."""

    key: K
    spec: S
    plugin: str
    overrides: bool = False


@dataclass
class Table(Generic[K, S]):
    """What one generation of the plugins provides, and a memo of what was derived from it (dropped with it)."""

    generation: object
    entries: dict[K, Entry[K, S]]
    memo: dict[Any, Any] = field(default_factory=dict)


def _by_name(spec: Any) -> list[Any]:
    return [spec.name]


class Registry(Generic[K, S]):
    """Key -> Entry, collected from every plugin's answer to ``hook``; rebuilt when the plugins change.

    ``hook``: the hookspec function; ``what``: what one entry is called in messages. A hook returns
    specs of ``spec_type`` (or ones ``accepts(spec)`` takes, ``expected`` naming them), each serving
    the keys ``keys(spec)`` (its ``name`` by default); ``keys=None``: the hook returns a mapping key ->
    spec, its keys checked by ``accepts_key`` (``expected_key`` says what they must be). ``missing``,
    ``listed`` and ``hint`` shape the not-found error.
    """

    def __init__(
        self,
        hook: Callable[..., Any],
        what: str,
        spec_type: type | None = None,
        *,
        plural: str = "",
        expected: str = "",
        accepts: Callable[[object], bool] | None = None,
        keys: Callable[[Any], Iterable[K]] | None = _by_name,
        accepts_key: Callable[[object], bool] = lambda key: True,
        expected_key: str = "",
        how_to_override: str = "",
        missing: type[NotProvidedError] = NotProvidedError,
        listed: str = "available",
        hint: str | Callable[[K], str] = "",
    ) -> None:
        self.hook, self.what, self.plural = hook, what, plural or f"{what}s"
        self.expected = expected or (f"{spec_type.__module__}.{spec_type.__qualname__}" if spec_type is not None else "?")
        if accepts is None:
            accepts = callable if spec_type is None else (lambda spec: isinstance(spec, spec_type))
        self._accepts = accepts
        self._keys, self._accepts_key, self._expected_key = keys, accepts_key, expected_key
        self._how_to_override = how_to_override or (
            f"declare overrides=True in the {spec_type.__qualname__ if spec_type else 'spec'} that should win" if keys is not None
            else f"map it to spmd.Overriding({what.split()[-1]}) in the plugin that should win")
        self._missing, self._listed, self._hint = missing, listed, hint
        self._table: Table[K, S] | None = None
        self._lock = threading.RLock()
        ALL.append(self)

    @property
    def hook_name(self) -> str:
        return self.hook.__name__

    def table(self) -> Table[K, S]:
        """This generation's table (built on first use, read without a lock afterwards)."""
        table = self._table
        if table is None or table.generation is not plugins.generation:
            pm = plugins.manager()  # first, outside the lock: a plugin loading now may look a key up here
            with self._lock:  # reentrant: a hook implementation may look a key up too
                table = self._table
                if table is None or table.generation is not plugins.generation:
                    generation = plugins.generation  # read before the hooks run: a change while they do rebuilds
                    table = self._table = Table(generation, self._collect(pm))
        return table

    def entries(self) -> dict[K, Entry[K, S]]:
        """Every entry by key (the table's own dict: do not change it)."""
        return self.table().entries

    def keys(self) -> list[K]:
        """Every key, sorted (by text, so op overloads sort too)."""
        return sorted(self.entries(), key=str)

    def find(self, key: K) -> Entry[K, S] | None:
        return self.entries().get(key)

    def get(self, key: K) -> Entry[K, S]:
        """The entry for ``key``, or the registry's not-found error listing every key there is."""
        entry = self.entries().get(key)
        if entry is None:
            raise self.not_found(key)
        return entry

    def not_found(self, key: K) -> NotProvidedError:
        """The error for a key no plugin provides: it lists every key there is, then the hint."""
        names = ", ".join(str(k) for k in self.keys()) or "none"
        hint = self._hint(key) if callable(self._hint) else self._hint
        return self._missing(f"unknown {self.what} {_show(key)}; {self._listed} {self.plural}: {names}" + (f". {hint}" if hint else ""))

    def reset(self) -> None:
        """Forget the table (it is rebuilt on next use)."""
        with self._lock:
            self._table = None

    def _collect(self, pm: plugins.PluginManager) -> dict[K, Entry[K, S]]:
        entries: dict[K, Entry[K, S]] = {}
        for plugin, answer in pm.results(self.hook):
            for key, spec, overrides in self._offers(plugin, answer):
                entry = Entry(key, spec, plugin, overrides)
                previous = entries.get(key)
                if previous is not None:
                    entry = self._settle(previous, entry)
                entries[key] = entry
        return entries

    def _offers(self, plugin: str, answer: Any) -> Iterable[tuple[K, S, bool]]:
        """(key, spec, overrides) for everything one plugin's answer offers, each checked."""
        if self._keys is None:
            if not isinstance(answer, Mapping):
                raise PluginSpecError(f"plugin {plugin!r} returned {type(answer).__name__} from {self.hook_name}(); expected a mapping to {self.expected}")
            pairs: Iterable[tuple[Any, Any]] = answer.items()
        else:
            pairs = ((None, spec) for spec in answer)
        for key, value in pairs:
            overrides = isinstance(value, Overriding)
            spec = value.value if overrides else value
            if not self._accepts(spec):
                raise PluginSpecError(f"plugin {plugin!r} returned {spec!r} from {self.hook_name}(); expected {self.expected}")
            overrides = overrides or bool(getattr(spec, "overrides", False))
            for k in [key] if self._keys is None else self._keys(spec):
                if not self._accepts_key(k):
                    raise PluginSpecError(f"plugin {plugin!r} returned a {self.what} for {k!r} from {self.hook_name}(); {self._expected_key}")
                yield k, spec, overrides

    def _settle(self, previous: Entry[K, S], entry: Entry[K, S]) -> Entry[K, S]:
        """Which of two entries under one key wins: the one that overrides; neither or both is a conflict."""
        if previous.overrides != entry.overrides:
            return entry if entry.overrides else previous
        both = "both declare overrides" if entry.overrides else "neither declares overrides"
        raise PluginConflictError(
            f"{self.what} {_show(entry.key)} is provided by two plugins: {previous.plugin!r} and {entry.plugin!r} ({both}). "
            f"Uninstall one, block one with SPMD_BLOCK_PLUGINS={entry.plugin}, or {self._how_to_override}"
        )


def _show(key: object) -> str:
    return repr(key) if isinstance(key, str) else str(key)
