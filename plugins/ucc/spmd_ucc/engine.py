"""The process's UCX engine: one context and worker shared by every group, endpoints, progress.

Imported only by the backend factory (see ``probe`` for why ``ucxx`` must not be
loaded at plugin import). One engine per process: every spmd group that uses
the ``ucc`` backend shares its worker and its endpoints, so a sub-group costs
no new connection.

Progress. UCX moves data only while someone calls ``worker.progress()``. Here
that someone is whichever thread waits: the first waiter becomes the leader
(it holds ``_lock``), progresses the worker, advances every in-flight operation
(``Pending.advance``), spins for ``spin_s`` and then sleeps in ``poll(2)`` on the
worker's event descriptor (UCX's blocking mode: ``arm`` then wait), so an idle
wait burns no CPU. Other waiters follow on a condition that the leader
notifies whenever something finished. A background thread does the same when
operations are in flight and nobody waits (async ops, done-callbacks), and
steps aside as soon as a waiter appears, so a synchronous collective never
pays a thread hand-off.

Peer failure. Endpoints are created with UCX's peer-failure handling, but the
shared-memory transports cannot notice a peer that died. So each process also
runs a second, TCP-only UCX worker (the sentinel) with one endpoint per peer:
when a peer's process exits, the kernel resets its sockets, the sentinel
endpoint fails at once, and every operation of a group containing that peer
fails with a CollectiveError naming it (instead of waiting for the timeout).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import select
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

from spmd.comm.threads import one_torch_thread
from spmd.errors import CollectiveError
from spmd_ucc import probe


def _env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    if not value:
        return default
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a number") from None


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value.lower() not in ("0", "n", "no", "false", "off")


class Pending:
    """Something in flight that the leader checks each round (a request, a collective)."""

    settled = False
    callback = False  # a done-callback waits for it: progress it even if nobody waits

    def advance(self) -> bool:
        """Advance; return True once finished (successfully or not). Called under the engine lock."""
        raise NotImplementedError

    def complete(self) -> None:
        """Deliver the result (runs callbacks); called outside the engine lock."""
        raise NotImplementedError


class Peer:
    """One remote process: its data endpoint, its sentinel endpoint, and whether it failed."""

    __slots__ = ("address", "ep", "sentinel_ep", "failure", "label", "__weakref__")

    def __init__(self, address: bytes, label: str) -> None:
        self.address = address
        self.ep: Any = None
        self.sentinel_ep: Any = None
        self.failure: str | None = None
        self.label = label


class Engine:
    """UCX context, worker and progress for this process (use ``get_engine()``)."""

    def __init__(self, options: dict[str, Any] | None = None, across_namespaces: bool = False) -> None:
        libucxx = probe.import_ucxx()
        self.libucxx = libucxx
        self.Array = probe.ucxx_array()
        self.Tag = libucxx.UCXXTag
        self.config = probe.ucx_config(options, across_namespaces)
        #: Whether UCX may use shared memory between processes in different network namespaces (see placement).
        self.shared_memory_across_namespaces = not across_namespaces and "UCX_TLS" not in os.environ and "TLS" not in self.config
        features = (libucxx.Feature.TAG, libucxx.Feature.WAKEUP)
        self.context = libucxx.UCXContext(config_dict=self.config, feature_flags=features)
        self.worker = libucxx.UCXWorker(self.context)
        self.worker.init_blocking_progress_mode()
        self.address = self.worker.address.tobytes()
        #: Peer-failure handling on data endpoints (SPMD_UCC_ERROR_HANDLING=0 turns it off, which
        #: lets UCX use transports without it, and makes a dead peer a timeout, not an error).
        self.error_handling = _env_flag("SPMD_UCC_ERROR_HANDLING", True)
        #: Seconds a waiter polls the worker before it sleeps on the event descriptor.
        self.spin_s = _env_float("SPMD_UCC_SPIN_US", 0.0) * 1e-6
        #: Yield the core between spins (sched_yield): free on an idle host, and on a busy one
        #: the peer we wait for may be the process waiting for this core.
        self.spin_yield = _env_flag("SPMD_UCC_SPIN_YIELD", False)
        self.sentinel_worker: Any = None
        self.sentinel_context: Any = None
        self.sentinel_address: bytes | None = None
        self.sentinel_error: str | None = None
        if _env_flag("SPMD_UCC_SENTINEL", True):
            try:
                self.sentinel_context = libucxx.UCXContext(config_dict={"TLS": "tcp"}, feature_flags=features)
                self.sentinel_worker = libucxx.UCXWorker(self.sentinel_context)
                self.sentinel_worker.init_blocking_progress_mode()
                self.sentinel_address = self.sentinel_worker.address.tobytes()
            except Exception as error:  # noqa: BLE001 - degrade to timeouts, and say so
                self.sentinel_worker = self.sentinel_context = None
                self.sentinel_error = f"{type(error).__name__}: {error}"
        self._fds = [self.worker.epoll_file_descriptor]
        if self.sentinel_worker is not None:
            self._fds.append(self.sentinel_worker.epoll_file_descriptor)
        self._poller = self._new_poller()  # used only by the leader (under _lock)
        self._lock = threading.Lock()  # the leader's: progress, poll() and every op's advance
        self._cond = threading.Condition(threading.Lock())  # followers and the background thread sleep here
        self._waiters = 0  # threads inside wait_until
        self._followers = 0  # of those, the ones sleeping on _cond
        self._active: list[Pending] = []
        self._active_lock = threading.Lock()
        self._peers: dict[bytes, Peer] = {}
        self._arrays: dict[tuple[int, int], Any] = {}
        self._peers_lock = threading.Lock()
        self._failed: list[Peer] = []
        self._zombies: list[tuple[Any, Any]] = []  # (request, buffer) of failed ops, kept until UCX lets go
        self._next_sentinel = 0.0
        self._backends: weakref.WeakSet[Any] = weakref.WeakSet()
        self._stopping = False
        self._bg_asleep = True  # the background thread sleeps until _wake_background
        self._thread = threading.Thread(target=self._background, name="spmd-ucc-progress", daemon=True)
        if _env_flag("SPMD_UCC_BACKGROUND", True):
            self._thread.start()

    def _new_poller(self) -> select.poll:
        poller = select.poll()
        for fd in self._fds:
            poller.register(fd, select.POLLIN)
        return poller

    # -- peers ---------------------------------------------------------------------
    def peer(self, address: bytes, sentinel_address: bytes | None, label: str) -> Peer:
        """The endpoint(s) to the process at ``address``, created on first use and shared."""
        peer = self._peers.get(address)
        if peer is not None:
            return peer
        with self._peers_lock:
            peer = self._peers.get(address)
            if peer is not None:
                return peer
            libucxx = self.libucxx
            peer = Peer(address, label)
            remote = libucxx.UCXAddress.create_from_buffer(address)
            peer.ep = self.worker.create_endpoint_from_worker_address(remote, self.error_handling)
            if self.error_handling:
                peer.ep.set_close_callback(self._on_peer_error, (peer, "its UCX endpoint failed"))
            if sentinel_address is not None and self.sentinel_worker is not None and address != self.address:
                sentinel = libucxx.UCXAddress.create_from_buffer(sentinel_address)
                peer.sentinel_ep = self.sentinel_worker.create_endpoint_from_worker_address(sentinel, True)
                peer.sentinel_ep.set_close_callback(self._on_peer_error, (peer, "its connection was reset (the process exited or was killed)"))
            self._peers[address] = peer
            return peer

    def _on_peer_error(self, peer: Peer, why: str) -> None:
        # Called by UCX from inside a progress call: record only, handled after progress returns.
        if peer.failure is None and not self._stopping:
            peer.failure = why
            self._failed.append(peer)

    def _handle_failures(self) -> None:
        failed, self._failed = self._failed, []
        for peer in failed:
            for backend in list(self._backends):
                backend.peer_failed(peer)
            try:
                closing = peer.ep.close()  # cancels every request still posted on it
            except Exception:  # noqa: BLE001, S110 - the endpoint is gone either way
                continue
            self._zombies.append((closing, None))  # dropping the request would cancel the close

    def add_backend(self, backend: Any) -> None:
        self._backends.add(backend)

    def bury(self, items: list[tuple[Any, Any]]) -> None:
        """Keep the requests (and buffers) of a failed op alive until UCX is done with them."""
        self._zombies.extend((req, buf) for req, buf in items if not req.completed)

    # -- buffers -------------------------------------------------------------------
    def array(self, tensor: Any) -> Any:
        """A ucxx Array over a contiguous tensor's memory, cached by (address, size).

        The Array holds a ctypes view that does not own the memory, so the cache
        keeps no tensor alive and a hit on reused memory is still the right
        (address, size); whoever posts the request keeps the tensor alive. After
        a context switch, building a view costs tens of microseconds here, more
        than the message.
        """
        key = (tensor.data_ptr(), tensor.nbytes)
        arr = self._arrays.get(key)
        if arr is None:
            if len(self._arrays) >= 4096:
                self._arrays.clear()
            arr = self.Array((ctypes.c_uint8 * key[1]).from_address(key[0]))
            self._arrays[key] = arr
        return arr

    # -- registration ----------------------------------------------------------------
    def register(self, item: Pending) -> None:
        """Track ``item`` until it finishes.

        The background thread is woken only when work is in flight that
        nobody may be waiting for: a second operation while one is pending
        (the first was not waited: async use), or a done-callback
        (``wants_callback``). A synchronous caller issues one operation and
        waits on it at once, and waking a thread for it would cost a switch.
        """
        with self._active_lock:
            self._active.append(item)
            several = len(self._active) > 1
        if several:
            self._wake_background()

    def wants_callback(self, item: Pending) -> None:
        """Someone registered a done-callback on ``item``: progress it even if nobody waits."""
        item.callback = True
        self._wake_background()

    def _wake_background(self) -> None:
        if self._bg_asleep and not self._waiters:
            with self._cond:
                self._cond.notify_all()

    def _background_needed(self) -> bool:
        active = self._active
        return bool(active) and not self._waiters and (len(active) > 1 or any(item.callback for item in active))

    # -- progress ------------------------------------------------------------------
    def _round(self) -> list[Pending]:
        """One progress round (under ``_lock``): progress UCX, advance ops, return the finished.

        The ops' reductions run on one torch thread (``one_torch_thread``): a parallel region's
        spinning threads would hold the core the peer rank needs (a 256 KiB all_reduce: 77 us -> 6 ms).
        """
        with one_torch_thread():
            return self._round_body()

    def _round_body(self) -> list[Pending]:
        self.worker.progress()
        if self.sentinel_worker is not None:
            now = time.monotonic()
            if now >= self._next_sentinel:
                self._next_sentinel = now + 0.005
                self.sentinel_worker.progress()
        if self._failed:
            self._handle_failures()
        if not self._active:
            return []
        with self._active_lock:
            snapshot = list(self._active)
        finished = []
        for item in snapshot:
            if item.advance():
                item.settled = True
                finished.append(item)
        if finished:
            with self._active_lock:
                self._active = [item for item in self._active if not item.settled]
        if self._zombies and len(self._zombies) > 64:
            self._zombies = [(req, buf) for req, buf in self._zombies if not req.completed]
        return finished

    def _deliver(self, finished: list[Pending]) -> None:
        for item in finished:
            item.complete()
        if self._followers:
            with self._cond:
                self._cond.notify_all()

    def _sleep(self, poller: select.poll, timeout_s: float | None) -> None:
        """Arm the workers and sleep until UCX signals an event (or the timeout)."""
        if not self.worker.arm():
            return  # events are pending: go round again
        sentinel = self.sentinel_worker
        if sentinel is not None and not sentinel.arm():
            sentinel.progress()
            return
        # At most 50 ms: rounds also check the sentinel and the failure grace, not only events.
        limit = 0.05 if timeout_s is None else min(max(timeout_s, 0.0), 0.05)
        for fd, _ in poller.poll(limit * 1000.0):
            if sentinel is not None and fd == self._fds[-1] and len(self._fds) > 1:
                self._next_sentinel = 0.0  # progress it in the next round

    def try_progress(self) -> None:
        """One non-blocking round if no other thread is progressing (for ``is_completed``)."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            finished = self._round()
        finally:
            self._lock.release()
        if finished:
            self._deliver(finished)

    def wait_until(self, done: Callable[[], bool], deadline: float | None) -> bool:
        """Drive progress until ``done()`` (True) or ``deadline`` (monotonic seconds) passes (False)."""
        if done():
            return True
        spin_until = time.perf_counter() + self.spin_s
        with self._cond:
            self._waiters += 1
        try:
            while True:
                if self._lock.acquire(blocking=False):
                    spinning = False
                    try:
                        finished = self._round()
                        if not finished and not done():
                            if time.perf_counter() < spin_until:
                                spinning = True
                            else:
                                remaining = None if deadline is None else deadline - time.monotonic()
                                if remaining is None or remaining > 0:
                                    self._sleep(self._poller, remaining)
                    finally:
                        self._lock.release()
                    if finished:
                        self._deliver(finished)
                    elif spinning and self.spin_yield:
                        os.sched_yield()  # on a busy host, let the peer (or anyone) have this core
                else:
                    with self._cond:
                        if not done():
                            self._followers += 1
                            self._cond.wait(0.001)
                            self._followers -= 1
                if done():
                    return True
                if deadline is not None and time.monotonic() >= deadline:
                    return False
        finally:
            with self._cond:
                self._waiters -= 1
                if not self._waiters and self._active:
                    self._cond.notify_all()  # left work in flight (a timed-out wait, async ops)

    def _background(self) -> None:
        """Progress in-flight work that nobody waits for; step aside whenever a waiter appears."""
        poller = self._new_poller()
        while not self._stopping:
            with self._cond:
                self._bg_asleep = True
                while not self._stopping and not self._background_needed():
                    self._cond.wait()
                self._bg_asleep = False
            while not self._stopping and self._active and not self._waiters:
                if not self._lock.acquire(blocking=False):
                    time.sleep(0.0005)
                    continue
                try:
                    finished = self._round()
                    armed = not finished and self.worker.arm()
                    if armed and self.sentinel_worker is not None and not self.sentinel_worker.arm():
                        armed = False
                finally:
                    self._lock.release()
                if finished:
                    self._deliver(finished)
                elif armed:
                    poller.poll(10.0)  # without the lock: a waiter can take over at once

    def shutdown(self) -> None:
        """Tear UCX down at interpreter exit, before Python finalizes.

        Left to garbage collection, UCX's destructors run during finalization
        and release the GIL; a daemon thread that then returns from a ucxx call
        (or a UCX error callback into Python) is killed by Python with a forced
        unwind through C++ frames, which aborts the process ("terminate called
        without an active exception"). So: stop the background thread, hold the
        progress lock for good (nobody progresses any more), unhook the endpoint
        callbacks, and destroy endpoints, workers and contexts now.
        """
        self._stopping = True
        with self._cond:
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(2.0)
        if not self._lock.acquire(timeout=2.0):
            return  # a thread is stuck inside UCX: leave everything as it is
        for peer in list(self._peers.values()):
            for ep in (peer.sentinel_ep, peer.ep):
                if ep is not None:
                    try:
                        ep.remove_close_callback()
                    except Exception:  # noqa: BLE001, S110 - best effort at exit
                        pass
            peer.failure = peer.failure or "the process is exiting"
            peer.ep = peer.sentinel_ep = None  # backends keep Peer objects, not UCX endpoints
        with self._active_lock:
            self._active = []
        self._peers.clear()
        self._zombies = []
        self._arrays.clear()
        self.sentinel_worker = self.sentinel_context = None
        self.worker = self.context = None


_engine: Engine | None = None
_engine_lock = threading.Lock()


def get_engine(options: dict[str, Any] | None = None, across_namespaces: bool = False) -> Engine:
    """The process's engine, created on first use with that group's ``ucx_*`` options.

    One UCX context per process: the first group to use ``ucc`` decides its
    settings; a later group asking for different ones gets a warning (one
    spanning network namespaces after a context with shared memory: see
    ``backend._spans_namespaces``).
    """
    global _engine
    if _engine is None:
        with _engine_lock:
            if _engine is None:
                _engine = Engine(options, across_namespaces)
                atexit.register(_engine.shutdown)
                return _engine
    wanted = probe.ucx_config(options, across_namespaces)
    if any(_engine.config.get(k) != v for k, v in wanted.items()):
        warnings.warn(
            f"spmd-ucc: this process's UCX context was created with {_engine.config}; the group "
            f"options asking for {wanted} cannot change it (one UCX context per process)",
            stacklevel=3,
        )
    return _engine


def existing_engine() -> Engine | None:
    """The process's engine if a group already created it (None: the next group decides its settings)."""
    return _engine


def peer_error(peer: Peer, what: str) -> CollectiveError:
    return CollectiveError(f"{what} failed: peer {peer.label} is unreachable: {peer.failure}")
