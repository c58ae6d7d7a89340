"""The per-node agent of ``spmd run``: rendezvous, start workers, watch, restart or report.

The loop: join a rendezvous round, start this node's workers with torchrun's
environment, and poll them and the round's flags every ``--monitor-interval``.
A local failure is published to the round, so every agent stops its workers
at once; the group restarts in a new round until ``--max-restarts`` is used
up, then the agent exits with the failing worker's code and a summary. A
newcomer (elastic MIN:MAX) asks for a new round, which restarts the workers
with the new world size without using up a restart. SIGINT/SIGTERM reach
every worker, and every agent of the job. An agent that loses the store (the
agent hosting it died) says so, naming that node, stops its workers
gracefully and exits 1. Each agent beats in the round's keys from a thread
(liveness.py): an agent waiting on another node's outcome or departure stops
waiting once that node's beats stand still for ``SILENT_S`` seconds, and
names the node as gone.

Under ``spmd run`` nothing the agent started outlives it (containment.py): at
every exit it stops what its workers left running and removes its temp
directories; if it is SIGKILLed, the kernel (PDEATHSIG) and its reaper process
do that.

Every agent reports the job's outcome, not only its own node's: an agent
whose workers all exited 0 waits (at most ``--rdzv-timeout``) until every
node's workers did. If a worker elsewhere fails meanwhile, it takes part in
the restart like the others (its workers start again), or, with no restart
left, exits with that worker's code and the summary. (torchrun exits 0 there
after its exit barrier.) A job whose workers have begun finishing is not
restarted for a newcomer.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from types import FrameType

import torch.distributed as tdist

from spmd.comm.tcp_store import job_scope
from spmd.errors import SpmdError
from spmd.launch.args import RunConfig
from spmd.launch.containment import Containment
from spmd.launch.liveness import SILENT_S, Heartbeat, Watch
from spmd.launch.logs import make_log_root, temporary_logs
from spmd.launch.rdzv_backends import RendezvousBackend, open_backend
from spmd.launch.rendezvous import Membership, Rendezvous
from spmd.launch.workers import Failure, WorkerGroup


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _say(message: str) -> None:
    print(f"spmd run: {message}", file=sys.stderr, flush=True)


class Agent:
    """One node's agent; ``run()`` returns the process exit code.

    ``contain``: make this process a subreaper and start a reaper process (containment.py), which
    ``spmd run`` wants and a test running an agent inside its own process does not.
    """

    def __init__(self, config: RunConfig, contain: bool = False) -> None:
        self.config = config
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"spmd-run-{config.rdzv_id}-"))
        if config.log_dir:
            Path(config.log_dir).mkdir(parents=True, exist_ok=True)
        self.log_root = make_log_root(config)
        #: What the agent removes at exit (and its reaper, if the agent is killed): its own temp directories.
        self.temp_dirs = [self.run_dir] + ([self.log_root] if self.log_root is not None and temporary_logs(config) else [])
        self.contain = contain
        self._containment: Containment | None = None
        self.group: WorkerGroup | None = None
        self.restarts = 0
        self._backend: RendezvousBackend | None = None
        self._left_last = False  # this agent saw every other agent leave: the job's rendezvous keys may go
        self._heartbeat: Heartbeat | None = None
        self._membership: Membership | None = None
        self._watch: Watch | None = None  # the other nodes' beats in this round

    # -- setup ---------------------------------------------------------------------------
    def _rendezvous(self) -> tuple[Rendezvous, bool, str]:
        """Connect to the job's rendezvous (the --rdzv-backend plugin); (rounds, hosting the agents' store, this node's address)."""
        c = self.config
        backend = open_backend(c)
        rdzv = Rendezvous(job_scope(backend.store, c.rdzv_token), c.rdzv_id, c.min_nodes, c.max_nodes, c.rdzv_timeout, c.last_call,
                          wait_on_store=backend.wakes_waiters)
        self._backend = backend
        self._store = backend.store  # keep a hosted server alive
        self._endpoint = backend.endpoint
        return rdzv, backend.hosting, backend.local_address

    def _round_store(self, rdzv: Rendezvous, membership: Membership, hosting: bool) -> tuple[str, bool]:
        """The workers' store for this round (host:port) and whether this agent hosts it."""
        if self._backend is None:
            return self._endpoint, hosting
        return self._backend.round_store(rdzv, membership)

    # -- main loop ---------------------------------------------------------------------------
    def run(self) -> int:
        previous = {s: signal.signal(s, self._on_signal) for s in self.config.signals}
        try:
            if self.contain:
                marker = f"TORCHELASTIC_ERROR_FILE={self.run_dir}{os.sep}"  # in every worker's environment (worker_env)
                self._containment = Containment(marker, self.temp_dirs)
            return self._run()
        except _Interrupted as interrupted:
            name = signal.Signals(interrupted.signum).name
            _say(f"received {name}; stopping workers")
            self._publish_shutdown(f"agent on {socket.gethostname()} received {name}")
            self._stop_group(interrupted.signum)
            return 128 + interrupted.signum
        except SpmdError as error:
            _say(str(error))
            self._stop_group()
            return 1
        except tdist.DistError as error:  # from the store's client: the store, in another agent, is gone (or stuck)
            if isinstance(error, tdist.DistNetworkError):
                what = "the agent hosting it exited or died"
            else:
                what = (str(error).splitlines() or [type(error).__name__])[0]
            _say(f"lost the rendezvous store at {getattr(self, '_endpoint', '?')}{self._store_host()}: {what}; "
                 "stopping this node's workers")
            self._stop_group()
            return 1
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            self._clean_up()

    def _store_host(self) -> str:
        """Which node of the job the lost store ran on, if it ran on one (the agents' store runs in one of them)."""
        m, host = self._membership, getattr(self, "_endpoint", "").rpartition(":")[0]
        if m is None or host not in m.hosts:
            return ""
        return f" (on node {m.hosts.index(host)})"

    def _stop_group(self, signum: int = signal.SIGTERM) -> None:
        """Stop this round's workers (their process groups), then whatever else they left running."""
        if self.group is None:
            return
        self.group.stop(signum)
        if self._containment is not None:
            self._containment.stop_leftovers(self.config.stop_grace, self.group.processes())
            self._containment.forget(self.group.processes())

    def _clean_up(self) -> None:
        """At every exit: no worker, nor anything a worker started, runs on; the temp directories go."""
        if self._heartbeat is not None:
            self._heartbeat.stop()
        if self.group is not None and self.group.workers_left():
            self.group.stop()  # (an exception no branch above expected)
        if self._containment is not None:
            self._containment.close(self.config.stop_grace, self.group.processes() if self.group is not None else None)
        for folder in self.temp_dirs:
            shutil.rmtree(folder, ignore_errors=True)
        if self._backend is not None:
            try:
                self._backend.close(last=self._left_last)
            except SpmdError as error:
                _say(f"could not release the rendezvous at {self._endpoint}: {error}")

    def _reap(self) -> None:
        """Reap adopted orphans that exited (this agent is their subreaper)."""
        if self._containment is not None and self.group is not None:
            self._containment.reap(self.group.processes())

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        raise _Interrupted(signum)

    def _publish_shutdown(self, reason: str) -> None:
        rdzv = getattr(self, "_rdzv", None)
        if rdzv is not None:
            try:
                rdzv.store.set("shutdown", reason)
            except Exception:  # noqa: BLE001 - the store may be gone already
                pass

    def _run(self) -> int:
        c = self.config
        rdzv, agents_store_here, me = self._rendezvous()
        self._rdzv = rdzv
        while True:
            membership = rdzv.join(c.nproc_per_node, c.node_rank, me)
            store_endpoint, hosting = self._round_store(rdzv, membership, agents_store_here)
            membership = replace(membership, store_endpoint=store_endpoint)
            if c.master_addr:  # --master-addr names node 0 as torchrun's static rendezvous does
                membership = replace(membership, master_addr=c.master_addr)
            round_ = membership.round
            self._membership = membership
            if self._heartbeat is not None:
                self._heartbeat.stop()
            self._heartbeat = Heartbeat(rdzv.store, round_, membership.node_rank).start()
            self._watch = Watch(rdzv.store, round_, [n for n in range(membership.num_nodes) if n != membership.node_rank])
            if membership.node_rank == 0:
                _say(
                    f"round {round_}: {membership.num_nodes} node(s), world size {membership.world_size}, "
                    f"master {membership.master_addr}:{membership.master_port}, restart {self.restarts}"
                )
            self.group = WorkerGroup(c, membership, self.restarts, self.run_dir / f"round{round_}", self.log_root)
            self.group.start()
            if self._containment is not None:
                self._containment.register(self.group.processes())
            outcome, failure = self._monitor(rdzv, membership, hosting)
            if outcome == "done":
                self.group.drain()  # every line the workers wrote reaches the console and the log files
                outcome, failure = self._await_job(rdzv, membership, hosting)
                if outcome == "done":
                    return 0
            # (the reason is read before the grace period: the agent that sent it may take the store down meanwhile)
            reason = rdzv.shutdown_requested() if outcome == "shutdown" else None
            self._stop_group()
            if outcome == "shutdown" and failure is None:
                _say(f"job stopped: {reason}")
                return 1
            if outcome == "join":
                _say(f"a node asked to join; restarting round {round_} as round {round_ + 1}")
                rdzv.advance_from(round_)
                continue
            assert failure is not None
            if self.restarts >= c.max_restarts or outcome == "shutdown":  # (a stop sent over a failure: the job ends with it)
                _say(f"job failed; restarts used {self.restarts}/{c.max_restarts}\n{failure.summary(membership.node_rank)}")
                if outcome != "shutdown":
                    self._publish_shutdown(f"job failed: rank {failure.rank} {failure.how}")
                # The others read the failure within a monitor step and stop their workers (up to
                # --stop-grace): the store they read it from stays until then, or they would report a lost store.
                self._leave(rdzv, membership, hosting, c.stop_grace + 5.0)
                return failure.exit_code if failure.exit_code else 1
            self.restarts += 1
            _say(f"{failure.summary().splitlines()[0]}; restarting the group ({self.restarts}/{c.max_restarts})")
            rdzv.advance_from(round_)

    def _monitor(self, rdzv: Rendezvous, membership: Membership, hosting: bool = False) -> tuple[str, Failure | None]:
        """Watch this node's workers and the round's keys until one says how the round goes on. The agent
        hosting the store also follows the other nodes' beats: when it has to wait for them, it knows already
        which went silent."""
        assert self.group is not None
        round_ = membership.round
        failed_key = rdzv.key(round_, "failed")
        join_key = rdzv.key(round_, "join")
        while True:
            done, failure = self.group.poll()
            if failure is not None:
                first = rdzv.store.compare_set(failed_key, "", failure.to_json())  # the first failure wins
                return "failed", Failure.from_json(first.decode())
            elsewhere = _failure_of(rdzv, failed_key)  # before trusting `done`: another node's failure fails the round
            if elsewhere is not None:
                return "failed", elsewhere
            if done:
                return "done", None
            if rdzv.store.check(["shutdown"]):
                return "shutdown", _failure_of(rdzv, failed_key)
            if rdzv.store.check([join_key]) and membership.num_nodes < self.config.max_nodes and not int(rdzv.store.add(rdzv.key(round_, "done"), 0)):
                return "join", None  # (not into a full round, nor once a node's workers finished: that job is ending)
            if hosting and self._watch is not None and self._watch.due():
                self._watch.silent()
            self._reap()
            time.sleep(self.config.monitor_interval)

    def _await_job(self, rdzv: Rendezvous, membership: Membership, hosting: bool) -> tuple[str, Failure | None]:
        """This node's workers all exited 0: wait (at most --rdzv-timeout) for the round's outcome on every node.

        Returns ("done", None) when every node's workers succeeded, ("failed", failure) when a worker
        elsewhere failed or a node that had not finished went silent (this agent then takes part in the
        restart or reports it), ("join", None) when the
        other agents moved to a new round for a newcomer, or ("shutdown", the round's failure if one was
        set). The agent hosting the store leaves last: it waits for every other agent to have seen the outcome.
        """
        round_, num_nodes, me = membership.round, membership.num_nodes, membership.node_rank
        done_key, failed_key = rdzv.key(round_, "done"), rdzv.key(round_, "failed")
        rdzv.set(round_, f"done{me}", "1")  # (before the counter: a node counted done is known by name)
        rdzv.store.add(done_key, 1)
        others = [n for n in range(num_nodes) if n != me]
        watch = self._watch or Watch(rdzv.store, round_, others)
        deadline = time.monotonic() + self.config.rdzv_timeout
        while True:
            moved = rdzv.current_round() > round_  # read before `failed`: a failing agent sets it before moving the round
            elsewhere = _failure_of(rdzv, failed_key)
            if elsewhere is not None:
                return "failed", elsewhere
            if moved:
                return "join", None
            finished = int(rdzv.store.add(done_key, 0))
            if finished >= num_nodes:
                break
            if rdzv.store.check(["shutdown"]):
                return "shutdown", _failure_of(rdzv, failed_key)
            gone = watch.due() and watch.silent([n for n in others if not rdzv.flag(round_, f"done{n}")])
            if gone:
                return "failed", _lost(membership, gone[0])
            if time.monotonic() > deadline:
                _say(f"this node's workers finished, but {num_nodes - finished} of {num_nodes} nodes were still running after "
                     f"{self.config.rdzv_timeout:.0f} s (--rdzv-timeout); exiting 0 without the job's outcome"
                     + (" (the rendezvous store this agent hosts goes with it)" if hosting else ""))
                return "done", None
            self._reap()
            time.sleep(self.config.monitor_interval)
        self._leave(rdzv, membership, hosting, self.config.rdzv_timeout)
        return "done", None

    def _leave(self, rdzv: Rendezvous, membership: Membership, hosting: bool, limit: float) -> None:
        """This agent has read the round's outcome and exits: say so; the agent hosting the store
        waits (at most ``limit`` seconds) until every other agent has said so or gone silent (named
        then), and takes it down."""
        round_, me = membership.round, membership.node_rank
        left_key = rdzv.key(round_, "left")
        if not hosting:
            try:
                rdzv.store.add(left_key, 1)  # (before the flag: a host that sees the flag finds the count)
                rdzv.set(round_, f"left{me}", "1")  # the host may take the store down now
            except Exception:  # noqa: BLE001 - the host stopped waiting for this agent: nothing left to tell it
                pass
            return
        others = [n for n in range(membership.num_nodes) if n != me]
        watch = self._watch or Watch(rdzv.store, round_, others)
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:  # every other agent's last look at the store comes first
            pending = [n for n in others if not rdzv.flag(round_, f"left{n}")]
            if not pending:
                break
            gone = watch.silent(pending) if watch.due() else []
            if len(gone) == len(pending):
                for node in gone:
                    _say(_lost(membership, node).summary())
                break
            time.sleep(self.config.monitor_interval)
        self._left_last = int(rdzv.store.add(left_key, 0)) >= len(others)


def _failure_of(rdzv: Rendezvous, failed_key: str) -> Failure | None:
    """The round's failure, if one was set: an agent sets it before it asks the job to stop, and an agent
    that saw the stop between its own looks at the two keys still reports the failure, not a bare stop."""
    return Failure.from_json(rdzv.store.get(failed_key).decode()) if rdzv.store.check([failed_key]) else None


def _lost(membership: Membership, node: int) -> Failure:
    """The failure of a node whose agent went silent, with the ranks it held."""
    first = sum(membership.nprocs[:node])
    return Failure.node_lost(node, membership.hosts[node], range(first, first + membership.nprocs[node]), SILENT_S)


def run(config: RunConfig) -> int:
    """Run one node's share of the job; the return value is the exit code."""
    if config.nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
        _say(f"setting OMP_NUM_THREADS=1 for each of the {config.nproc_per_node} workers (set it yourself to override)")
    return Agent(config, contain=True).run()
