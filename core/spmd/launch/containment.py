"""Nothing a ``spmd run`` agent started outlives it: workers, their descendants, its temp directories.

How (the Linux-only parts are skipped elsewhere, or where libc's ``prctl`` cannot be called):

- Each worker starts in a session of its own (workers.py), so one ``killpg`` reaches it and every
  descendant that stayed in its process group (a ``subprocess`` child, DataLoader workers).
- Each worker gets ``PR_SET_PDEATHSIG=SIGKILL`` before exec (:func:`die_with_agent`): the kernel kills
  it when the agent thread that started it ends, however the agent ends, SIGKILL included. The
  agent starts workers from the thread that runs it (the main thread under ``spmd run``).
- The agent is a ``PR_SET_CHILD_SUBREAPER``: descendants orphaned while the job runs (a double fork, a
  helper whose parent exited) become the agent's children, not init's. It reaps those that exit, and
  whenever it stops a group and when it exits (normally, on a failure, on a signal) it stops every
  descendant still running and every process carrying its marker (SIGTERM, SIGKILL after
  ``--stop-grace``): :meth:`Containment.stop_leftovers`.
- PDEATHSIG reaches only the workers, and a SIGKILLed agent does nothing more. So a per-node reaper
  process (reaper.py: the standard library only, a session of its own) holds a pipe from the agent;
  when the pipe ends without the agent's ``exit`` it SIGKILLs the worker groups and every process
  that carries the agent's marker (the workers' ``TORCHELASTIC_ERROR_FILE``, which names the agent's
  unique temp directory and which descendants inherit), and removes the agent's temp directories.

What can still escape: a process that both left its worker's process group and was started with an
environment without the marker, when the agent is SIGKILLed (a normal exit stops it: it is a
descendant), and any process of a worker stuck in the kernel (reported by WorkerGroup.stop).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

from spmd.launch.reaper import leftovers

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
#: How long the agent waits, after SIGKILL, for leftovers to be gone, and for the reaper to exit.
GONE_WAIT_S = 5.0


def _prctl() -> Callable[..., int] | None:
    """libc's prctl (loaded in the agent: a child between fork and exec must not dlopen), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return prctl


_PRCTL = _prctl()


def die_with_agent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the kernel SIGKILL the child when this thread ends; None where unsupported."""
    prctl, agent = _PRCTL, os.getpid()
    if prctl is None:
        return None

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != agent:  # the agent died before the call above: no signal will come
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def become_subreaper() -> bool:
    """Make orphaned descendants of this process its children (Linux); whether that took effect."""
    return _PRCTL is not None and _PRCTL(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


class Containment:
    """This agent's hold on its descendants: subreaper, reaper process, leftovers stopped at exit."""

    def __init__(self, marker: str, temp_dirs: Sequence[Path]) -> None:
        self.marker = marker
        self.groups: set[int] = set()  # the registered worker groups (stopped through them where there is no /proc)
        self.subreaper = become_subreaper()
        self.reaper: subprocess.Popen | None = None
        try:
            self.reaper = subprocess.Popen(
                [sys.executable, "-I", "-S", str(Path(__file__).with_name("reaper.py")), marker, str(os.getpgid(0)), *map(str, temp_dirs)],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True,
            )
        except OSError as error:
            _say(f"cannot start the reaper process ({error}): if this agent is SIGKILLed, its workers' children may live on")

    def register(self, pgids: Iterable[int]) -> None:
        """Worker process groups the reaper kills if the agent dies."""
        self.groups.update(pgids := list(pgids))
        self._send("".join(f"+{pgid}\n" for pgid in pgids))

    def forget(self, pgids: Iterable[int]) -> None:
        """Worker groups the agent stopped and reaped (their numbers may be reused)."""
        self.groups.difference_update(pgids := list(pgids))
        self._send("".join(f"-{pgid}\n" for pgid in pgids))

    def _send(self, text: str) -> None:
        if self.reaper is None or self.reaper.stdin is None or not text:
            return
        try:
            self.reaper.stdin.write(text.encode())
            self.reaper.stdin.flush()
        except OSError as error:  # someone killed the reaper: the agent goes on without it
            _say(f"the reaper process (pid {self.reaper.pid}) is gone ({error}); if this agent is SIGKILLed, its workers' children may live on")
            self.reaper = None

    def reap(self, owned: Mapping[int, subprocess.Popen]) -> None:
        """Reap adopted children that exited (a subreaper's duty: they would stay zombies); a child that
        a Popen in ``owned`` (or the reaper's) stands for is left to that Popen, which keeps its status."""
        if not self.subreaper:
            return
        if self.reaper is not None:
            owned = {**owned, self.reaper.pid: self.reaper}
        for _ in range(1024):
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return
            if info is None:
                return
            if info.si_pid in owned:
                if owned[info.si_pid].poll() is None:  # (another thread is reaping it)
                    return
                continue
            try:
                os.waitpid(info.si_pid, os.WNOHANG)
            except ChildProcessError:
                pass

    def stop_leftovers(self, grace: float, owned: Mapping[int, subprocess.Popen] | None = None) -> None:
        """Stop every descendant still running and every process with the marker: SIGTERM, then SIGKILL
        after ``grace`` seconds; wait (at most GONE_WAIT_S) for them to be gone. Without /proc: the
        registered worker groups, SIGTERM then SIGKILL."""
        if not os.path.isdir("/proc/self"):
            for signum in (signal.SIGTERM, signal.SIGKILL):
                for pgid in self.groups:
                    try:
                        os.killpg(pgid, signum)
                    except (ProcessLookupError, PermissionError):
                        pass
            return
        spare = [self.reaper.pid] if self.reaper is not None else []
        found = leftovers(self.marker, root=os.getpid(), spare=spare)
        for signum, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, GONE_WAIT_S)):
            if not found:
                return
            for pid in found:
                try:
                    os.kill(pid, signum)
                except (ProcessLookupError, PermissionError):
                    pass
            deadline = time.monotonic() + wait
            while found and time.monotonic() < deadline:
                time.sleep(0.05)
                self.reap(owned or {})
                found = leftovers(self.marker, root=os.getpid(), spare=spare)
        if found:
            _say(f"{len(found)} process(es) the workers started did not exit {GONE_WAIT_S:.0f} s after SIGKILL "
                 f"(stuck in the kernel?): pids {sorted(found)}")

    def close(self, grace: float, owned: Mapping[int, subprocess.Popen] | None = None) -> None:
        """At the agent's exit: stop the leftovers, tell the reaper all is clean, and wait for it."""
        self.stop_leftovers(grace, owned)
        self._send("exit\n")
        if self.reaper is None:
            return
        try:
            if self.reaper.stdin is not None:
                self.reaper.stdin.close()
            self.reaper.wait(timeout=GONE_WAIT_S)
        except (OSError, subprocess.TimeoutExpired):
            self.reaper.kill()
            self.reaper.wait()


def _say(message: str) -> None:
    print(f"spmd run: {message}", file=sys.stderr, flush=True)
