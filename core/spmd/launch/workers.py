"""Start, watch and stop one node's worker processes.

Workers get torchrun's environment, their own session (so a stop reaches
their children too) and PR_SET_PDEATHSIG (so none outlives a killed agent;
containment.py has the rest of that story).
Their stdout/stderr pass through reader threads, chunk by chunk as written:
to the console (each line prefixed by rank under --tee), to per-rank log
files, and into a short tail kept for the failure summary.
"""

from __future__ import annotations

import collections
import functools
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from spmd.comm.address import binding_towards
from spmd.launch import worker_store
from spmd.launch.args import RunConfig
from spmd.launch.console import CONSOLE_VARIABLE, agent_console_is_terminal
from spmd.launch.containment import die_with_agent
from spmd.launch.logs import LogFile, open_log
from spmd.launch.rendezvous import Membership

TAIL_LINES = 40
#: Of a longer line of a worker's stderr, the tail kept for the failure summary keeps the end.
TAIL_LINE_BYTES = 4096
#: The most one read of a worker's output takes; it is forwarded at once.
READ_BYTES = 65536
#: How long the end of a line that has not ended yet waits for the rest before it is forwarded as is:
#: a worker's output into a pipe is flushed in 8 KiB blocks, and forwarding those as they come would
#: mix the ranks' lines mid-line, while a progress bar or a prompt must still show.
PARTIAL_LINE_S = 0.2


@dataclass
class Worker:
    """One worker process and what the agent remembers about it."""

    local_rank: int
    rank: int
    proc: subprocess.Popen
    error_file: Path
    stderr_tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    threads: list[threading.Thread] = field(default_factory=list)


@dataclass(frozen=True)
class Failure:
    """A worker that exited badly: who, where, how, and its last words."""

    rank: int
    local_rank: int
    node_rank: int
    host: str
    returncode: int
    detail: str
    on_console: bool = False  # its stderr went to its node's terminal as it was written
    #: Not one worker: the whole node went silent (``node_lost``); ``rank`` is its first rank.
    node_gone: bool = False

    @property
    def how(self) -> str:
        if self.returncode < 0:
            try:
                return f"killed by signal {signal.Signals(-self.returncode).name}"
            except ValueError:
                return f"killed by signal {-self.returncode}"
        return f"exited with code {self.returncode}"

    @property
    def exit_code(self) -> int:
        """The agent's own exit code for this failure (shell convention for signals)."""
        return 128 - self.returncode if self.returncode < 0 else self.returncode

    @classmethod
    def node_lost(cls, node_rank: int, host: str, ranks: range, silent_s: float) -> Failure:
        """Node ``node_rank``'s agent stopped beating for ``silent_s`` seconds: the node and its ranks are gone."""
        return cls(ranks.start, 0, node_rank, host, 1, f"its agent stopped beating for {silent_s:.0f} s (killed, its machine down, "
                   f"or its link cut): ranks {ranks.start}..{ranks.stop - 1} are lost with it", node_gone=True)

    def summary(self, node_rank: int | None = None) -> str:
        """Who failed and how; its last output too unless ``node_rank``'s terminal showed it already."""
        if self.node_gone:
            return f"node {self.node_rank} ({self.host}) is gone: {self.detail}"
        lines = [f"rank {self.rank} (local rank {self.local_rank}) on node {self.node_rank} ({self.host}) {self.how}"]
        if not self.detail.strip():
            lines.append("  (no traceback in its output)")
        elif self.on_console and node_rank == self.node_rank:
            lines.append("  its error is printed above (once)")
        else:
            lines.append("  its last output:")
            lines += [f"    {line}" for line in self.detail.rstrip().splitlines()]
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, text: str) -> Failure:
        return cls(**json.loads(text))


def _command(config: RunConfig) -> list[str]:
    if config.no_python:
        return [config.script, *config.script_args]
    if config.module:
        return [sys.executable, "-u", "-m", config.script, *config.script_args]
    return [sys.executable, "-u", config.script, *config.script_args]


def _gloo_interface(store_endpoint: str) -> str | None:
    """The interface towards the job's store, for torch's own Gloo (plain ``torch.distributed`` scripts).

    torch's Gloo binds to what this host's name resolves to (often 127.0.1.1 in
    containers) unless GLOO_SOCKET_IFNAME names an interface; a user's value
    is kept, and a loopback-only job gets nothing.
    """
    if "GLOO_SOCKET_IFNAME" in os.environ:
        return None
    on_etcd = worker_store.address(store_endpoint)
    if on_etcd is not None:
        return binding_towards(*on_etcd).interface
    host, _, port = store_endpoint.rpartition(":")
    return binding_towards(host, int(port)).interface if port.isdigit() else None


def worker_env(config: RunConfig, m: Membership, local_rank: int, restart: int, run_dir: Path) -> dict[str, str]:
    """torchrun's variables, plus the spmd names for the restart counter."""
    env = dict(os.environ)
    rank = m.rank_offset + local_rank
    env.update({
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(m.world_size),
        "LOCAL_WORLD_SIZE": str(config.nproc_per_node),
        "GROUP_RANK": str(m.node_rank),
        "GROUP_WORLD_SIZE": str(m.num_nodes),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(m.world_size),
        "ROLE_NAME": "default",
        "MASTER_ADDR": m.master_addr,
        "MASTER_PORT": str(m.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(restart),
        "SPMD_RESTART_COUNT": str(restart),
        "TORCHELASTIC_MAX_RESTARTS": str(config.max_restarts),
        "TORCHELASTIC_RUN_ID": config.rdzv_id,
        "SPMD_RUN_ID": config.rdzv_id,
        "TORCHELASTIC_ERROR_FILE": str(run_dir / f"error_{local_rank}.json"),
        "PYTHONUNBUFFERED": "1",
    })
    if m.store_endpoint is not None:
        env["SPMD_AGENT_STORE"] = m.store_endpoint  # spmd.init keeps its keys there, under:
        env["SPMD_STORE_PREFIX"] = f"spmd/job/{config.rdzv_id}/round{m.round}"
        gloo_interface = _gloo_interface(m.store_endpoint)
        if gloo_interface is not None:
            env["GLOO_SOCKET_IFNAME"] = gloo_interface
    if config.rdzv_token:
        env["SPMD_RDZV_TOKEN"] = config.rdzv_token  # spmd.init scopes the job's keys with it, as the agents do
    if agent_console_is_terminal():  # workers write into pipes: tell them a terminal shows what they write
        env[CONSOLE_VARIABLE] = "1"
    else:
        env.pop(CONSOLE_VARIABLE, None)  # (an outer spmd run's, not this console's)
    if config.nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = "1"  # as torchrun: ranks sharing a node must not oversubscribe it
    return env


class _Prefixer:
    """Puts a rank's prefix at each line start of output that arrives in chunks.

    A line starts after ``\n``, and after a ``\r`` that is not half of ``\r\n`` (a progress bar
    redrawn with ``\r`` keeps its prefix). A line that already starts with the prefix (torch's
    excepthook writes it) gets none; a line's first bytes that may still turn out to be the prefix
    wait for the next chunk.
    """

    def __init__(self, prefix: bytes) -> None:
        self.prefix = prefix
        self.at_start, self.after_cr = True, False
        self.held = b""

    def feed(self, data: bytes) -> bytes:
        if not self.prefix:
            return data
        data, self.held = self.held + data, b""
        out: list[bytes] = []
        i = 0
        while i < len(data):
            if self.at_start:
                first = data[i:i + 1]
                if first == b"\r" or (first == b"\n" and self.after_cr):
                    out.append(first)  # a line that is only \r, or the \n of \r\n: nothing to prefix
                    self.after_cr = first == b"\r"
                    i += 1
                    continue
                head = data[i:i + len(self.prefix)]
                if len(head) < len(self.prefix) and self.prefix.startswith(head):
                    self.held = head  # the chunk ends here: wait for the rest of the line's start
                    break
                if head != self.prefix:
                    out.append(self.prefix)
                self.at_start = self.after_cr = False
            end = _LINE_END.search(data, i)
            if end is None:
                out.append(data[i:])
                break
            out.append(data[i:end.end()])
            self.at_start, self.after_cr = True, end.group() == b"\r"
            i = end.end()
        return b"".join(out)

    def flush(self) -> bytes:
        """What is still held at the end of the stream (a line's start that was not the prefix after all)."""
        held, self.held = self.held, b""
        return self.prefix + held if held else b""


_LINE_END = re.compile(rb"[\r\n]")


class _Sink:
    """Where one stream of one worker goes: console (maybe prefixed), a file, the tail."""

    def __init__(self, console: IO[bytes] | None, prefix: bytes, log: LogFile | None, tail: collections.deque | None) -> None:
        self.console, self.prefix, self.log, self.tail = console, prefix, log, tail
        self.prefixer = _Prefixer(prefix)
        self.line = b""  # the tail's line in progress: its last TAIL_LINE_BYTES

    def pump(self, stream: IO[bytes]) -> None:
        """Forward what the worker writes, as it comes, until it closes the stream.

        Chunks, not lines: a progress bar redrawn with ``\r`` shows as it moves, and a
        long line is never held whole. A destination that fails (a console piped into
        ``head`` that exited, a full disk) is dropped with one note and the stream is
        still drained: a worker must never block writing to a pipe nobody reads.
        """
        fd = _fileno(stream)
        read: Callable[[int], bytes]
        if fd is not None:  # a pipe: read what is there, and see whether more comes within PARTIAL_LINE_S
            read = functools.partial(os.read, fd)
        else:
            read = getattr(stream, "read1", stream.read)  # read1: what one read gives, without waiting for more
        held = b""  # the start of a line that has not ended yet
        while True:
            if held and fd is not None and not select.select([fd], [], [], PARTIAL_LINE_S)[0]:
                self._to_console(self.prefixer.feed(held))  # nothing more came: a progress bar, a prompt
                held = b""
            chunk = read(READ_BYTES)
            if not chunk:
                break
            self._to_log(chunk)
            self._keep(chunk)
            data = held + chunk
            cut = max(data.rfind(b"\n"), data.rfind(b"\r")) + 1  # forward whole lines (\r ends a redrawn one)
            if fd is None or len(data) - cut > READ_BYTES:
                cut = len(data)  # (no way to wait for more, or a line too long to hold)
            self._to_console(self.prefixer.feed(data[:cut]))
            held = data[cut:]
        self._to_console(self.prefixer.feed(held) + self.prefixer.flush())
        if self.tail is not None and self.line:
            self.tail.append(_visible(self.line))
        stream.close()
        if self.log is not None:
            self.log.close()

    def _to_log(self, data: bytes) -> None:
        if self.log is not None:
            try:
                self.log.write(data)
                self.log.flush()
            except OSError as error:
                self._drop(self.log, f"log file {getattr(self.log, 'name', '')}", error)
                self.log = None

    def _to_console(self, data: bytes) -> None:
        if self.console is not None and data:
            try:
                with _CONSOLE_LOCK:
                    self.console.write(data)
                    self.console.flush()
            except OSError as error:
                self._drop(None, "console", error)
                self.console = None

    def _keep(self, data: bytes) -> None:
        """Keep the stream's last lines for the failure summary, each cut to its last TAIL_LINE_BYTES."""
        if self.tail is None:
            return
        *lines, rest = data.split(b"\n")
        if len(lines) > TAIL_LINES:  # the line in progress and the first ones would fall out of the tail anyway
            lines, self.line = lines[-TAIL_LINES:], b""
        for line in lines:
            self.tail.append(_visible(self.line + line))
            self.line = b""
        self.line = (self.line + rest)[-TAIL_LINE_BYTES:]

    def _drop(self, closing: LogFile | None, what: str, error: OSError) -> None:
        """Stop forwarding to a destination that failed, say so once on stderr (if it can), keep draining."""
        if closing is not None:
            try:
                closing.close()
            except OSError:
                pass
        try:
            sys.stderr.write(f"spmd run: stopped forwarding {self.prefix.decode().strip() or 'a worker'}'s output to the {what}: {error}\n")
        except OSError:
            pass


_CONSOLE_LOCK = threading.Lock()
#: Seconds ``WorkerGroup.stop`` waits for workers to die after SIGKILL before it reports and leaves them.
KILL_WAIT_S = 30.0


class WorkerGroup:
    """The workers of this node for one rendezvous round."""

    def __init__(self, config: RunConfig, membership: Membership, restart: int, run_dir: Path, log_root: Path | None = None) -> None:
        self.config, self.membership, self.restart = config, membership, restart
        self.run_dir = run_dir
        self.log_root = log_root  # this agent's own log directory (see make_log_root), None when no output goes to files
        self.workers: list[Worker] = []

    def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        cmd = _command(self.config)
        for local_rank in range(self.config.nproc_per_node):
            env = worker_env(self.config, self.membership, local_rank, self.restart, self.run_dir)
            error_file = Path(env["TORCHELASTIC_ERROR_FILE"])
            error_file.unlink(missing_ok=True)
            try:
                proc = subprocess.Popen(
                    cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    start_new_session=True, preexec_fn=die_with_agent(),
                )
            except FileNotFoundError as error:
                self.stop()
                raise SystemExit(f"spmd run: cannot start {cmd[0]!r}: {error.strerror}") from error
            worker = Worker(local_rank, int(env["RANK"]), proc, error_file)
            self._wire(worker)
            self.workers.append(worker)

    def _log_file(self, local_rank: int, name: str, redirected: bool) -> LogFile | None:
        if self.log_root is None:
            return None
        folder = self.log_root / f"attempt_{self.restart}" / str(local_rank)
        folder.mkdir(parents=True, exist_ok=True)
        return open_log(self.config, folder / f"{name}.log", redirected)

    def _wire(self, worker: Worker) -> None:
        tee, redirect = self.config.tee[worker.local_rank], self.config.redirects[worker.local_rank]
        for bit, name, console, stream in ((1, "stdout", sys.stdout.buffer, worker.proc.stdout), (2, "stderr", sys.stderr.buffer, worker.proc.stderr)):
            to_file = bool((tee | redirect) & bit)
            to_console = not (redirect & bit)
            prefix = f"[rank{worker.rank}]: ".encode() if tee & bit else b""
            sink = _Sink(
                console if to_console else None,
                prefix,
                self._log_file(worker.local_rank, name, bool(redirect & bit)) if to_file else None,
                worker.stderr_tail if name == "stderr" else None,
            )
            thread = threading.Thread(target=sink.pump, args=(stream,), daemon=True, name=f"spmd-{name}-{worker.rank}")
            thread.start()
            worker.threads.append(thread)

    def poll(self) -> tuple[bool, Failure | None]:
        """(all exited successfully, the failure to report if any).

        When several workers have failed by the time of a poll, one killed by a
        signal is reported before those that exited with an error: the others
        most likely exited because it died (a peer's collective broke), and on
        a loaded machine they are gone before the agent looks.
        """
        all_done = True
        failed: list[tuple[Worker, int]] = []
        for worker in self.workers:
            code = worker.proc.poll()
            if code is None:
                all_done = False
            elif code != 0:
                failed.append((worker, code))
        if failed:
            worker, code = min(failed, key=lambda item: item[1] > 0)  # signals (code < 0) first, then rank order
            return False, self._failure(worker, code)
        return all_done, None

    def _failure(self, worker: Worker, code: int) -> Failure:
        for thread in worker.threads:
            thread.join(timeout=1.0)  # let the pumps drain the last lines
        detail = _error_file_message(worker.error_file) or _last_traceback(list(worker.stderr_tail))
        on_console = not self.config.redirects[worker.local_rank] & 2
        return Failure(worker.rank, worker.local_rank, self.membership.node_rank, self.membership.hosts[self.membership.node_rank],
                       code, detail, on_console)

    def signal_all(self, signum: int) -> None:
        """Signal every worker's process group: its children too, also those of a worker that already
        exited (the group lives on while any member does; a reaped worker's empty group is skipped)."""
        for worker in self.workers:
            try:
                os.killpg(worker.proc.pid, signum)
            except (ProcessLookupError, PermissionError):
                pass

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """Signal every worker's process group, then SIGKILL what is left after the grace period.

        A worker that even SIGKILL does not end within ``KILL_WAIT_S`` (stuck in
        the kernel: a wedged driver, a hung network file system) is reported and
        left behind, so the agent can still report, restart or exit.
        """
        self.signal_all(signum)
        deadline = time.monotonic() + self.config.stop_grace
        for worker in self.workers:
            try:
                worker.proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                pass
        self.signal_all(signal.SIGKILL)
        deadline = time.monotonic() + KILL_WAIT_S
        for worker in self.workers:
            try:
                worker.proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                sys.stderr.write(f"spmd run: rank {worker.rank} (pid {worker.proc.pid}) did not exit {KILL_WAIT_S:.0f} s after SIGKILL "
                                 "(stuck in the kernel: a device driver or network file system?); leaving it\n")
                continue
            for thread in worker.threads:
                thread.join(timeout=1.0)

    def drain(self, timeout: float = 10.0) -> None:
        """Wait (at most ``timeout`` s in all) for the workers' output to be forwarded to its end.

        The workers have exited, but the pump threads may still be writing
        their last lines (a slow console): returning before them loses output.
        A pipe a worker's own child keeps open is given up on at the timeout.
        """
        deadline = time.monotonic() + timeout
        for worker in self.workers:
            for thread in worker.threads:
                thread.join(timeout=max(deadline - time.monotonic(), 0.0))

    def pids(self) -> Mapping[int, int]:
        return {w.rank: w.proc.pid for w in self.workers}

    def workers_left(self) -> bool:
        """Whether any worker of this group still runs."""
        return any(w.proc.poll() is None for w in self.workers)

    def processes(self) -> dict[int, subprocess.Popen]:
        """The workers' processes by pid (each is the leader of its own process group)."""
        return {w.proc.pid: w.proc for w in self.workers}


def _error_file_message(path: Path) -> str:
    """The traceback a worker wrote in torchelastic's error-file format, if it did."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return ""
    message = data.get("message", data)
    if isinstance(message, dict):
        extra = message.get("extraInfo", {})
        return str(extra.get("py_callstack") or message.get("message", ""))
    return str(message)


def _fileno(stream: IO[bytes]) -> int | None:
    """The stream's file descriptor, or None (a stream that has none)."""
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):  # (io.UnsupportedOperation is both OSError and ValueError)
        return None


def _visible(line: bytes) -> str:
    """A line of the tail as a terminal shows it: its last TAIL_LINE_BYTES, after its last ``\r`` (progress redraws)."""
    return line[-TAIL_LINE_BYTES:].rstrip(b"\r").rpartition(b"\r")[2].decode(errors="replace")


def _last_traceback(lines: list[str]) -> str:
    """The last Python traceback in a stderr tail, or the tail itself."""
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    chosen = lines[starts[-1]:] if starts else lines[-10:]
    return "\n".join(chosen)
