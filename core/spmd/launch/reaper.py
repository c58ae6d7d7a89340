"""The per-node reaper: ends a ``spmd run`` agent's processes and temp directories when the agent goes.

Runs as ``python -I -S reaper.py MARKER AGENT_PGID [PATH ...]`` (standard library only, so it starts
in milliseconds and imports neither torch nor spmd), in a session of its own, with a pipe from the
agent as its stdin. The agent writes ``+PGID`` when a worker (a process group leader) starts, ``-PGID``
once it has stopped and reaped that worker's group, and ``exit`` when it has cleaned up after itself.
Anything else the pipe can end with — the agent SIGKILLed, crashed, or ended by the OOM killer — is
end of file, and the reaper then SIGKILLs what the agent left:

- the registered worker process groups, each at once (not one whose number a newer process took);
- on Linux, every process whose environment carries ``MARKER`` (the worker variable that names the
  agent's own temp directory, unique per agent, which workers' descendants inherit: also those that
  left the worker's process group) and the members of their process groups, found by looking at
  ``/proc`` (again, up to SWEEPS times, for what forked meanwhile);

and then removes ``PATH ...`` (the agent's temp directories). The agent uses :func:`leftovers` too,
at its own exit, for what its workers left running.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
from collections.abc import Iterable

#: Looks at /proc the reaper takes, after SIGKILLing what the previous one found, for processes that forked meanwhile.
SWEEPS = 5


def _stat(pid: int) -> tuple[str, int, int, int] | None:
    """(state, parent pid, process group, start time) of ``pid`` from /proc, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rfind(b")") + 2:].split()  # after "pid (comm) ", comm may hold spaces and parentheses
    return fields[0].decode(), int(fields[1]), int(fields[2]), int(fields[19])


def _has_marker(pid: int, marker: bytes) -> bool:
    """Whether ``pid``'s environment (as it was at exec) holds the entry ``marker`` starts."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return (b"\0" + marker) in (b"\0" + f.read())
    except OSError:  # gone, or another user's: not ours
        return False


def leftovers(marker: str, root: int | None = None, spare: Iterable[int] = (), spare_group: int | None = None) -> set[int]:
    """Live processes that belong to an agent: those carrying ``marker``, the members of their process
    groups, and (when ``root`` is given) every descendant of ``root``; ``root`` and ``spare`` excluded,
    and the members of the caller's and ``spare_group``'s process groups (the agent's: a ``| tee`` there).

    Empty without ``/proc`` (not Linux). Zombies count as gone: they are dead and only wait to be reaped.
    """
    if not os.path.isdir("/proc/self"):
        return set()
    spared = {os.getpid(), *spare} | ({root} if root is not None else set())
    stats: dict[int, tuple[str, int, int, int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (stat := _stat(int(name))) is not None and stat[0] != "Z":
            stats[int(name)] = stat
    raw = marker.encode()
    marked = {pid for pid in stats if pid not in spared and _has_marker(pid, raw)}
    groups = {stats[pid][2] for pid in marked} - {os.getpgid(0), spare_group}
    found = marked | {pid for pid, (_, _, pgid, _) in stats.items() if pgid in groups}
    if root is not None:
        children: dict[int, list[int]] = {}
        for pid, (_, ppid, _, _) in stats.items():
            children.setdefault(ppid, []).append(pid)
        todo = list(children.get(root, ()))
        while todo:
            pid = todo.pop()
            found.add(pid)
            todo += children.get(pid, ())
    return found - spared


def _kill(pids: Iterable[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def _read_commands(groups: dict[int, int | None]) -> bool:
    """Follow the agent's lines until its pipe ends; True when it said ``exit`` (it cleaned up itself).

    ``groups`` maps each registered worker group to its leader's start time (None without /proc).
    """
    for line in sys.stdin.buffer:
        command = line.strip()
        if command == b"exit":
            return True
        if command[:1] == b"+" and command[1:].isdigit():
            stat = _stat(int(command[1:]))
            groups[int(command[1:])] = stat[3] if stat is not None else None
        elif command[:1] == b"-" and command[1:].isdigit():
            groups.pop(int(command[1:]), None)
    return False


def _kill_groups(groups: dict[int, int | None], agent_group: int) -> None:
    """SIGKILL the registered worker groups, all members at once; not one whose number a newer
    process now has (its leader, our worker, exited and the number was reused)."""
    for pgid, started in groups.items():
        if pgid in (agent_group, os.getpgid(0)):
            continue
        now = _stat(pgid)
        if now is not None and started is not None and now[3] != started:
            continue
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def main(argv: list[str]) -> int:
    marker, agent_group, paths = argv[0], int(argv[1]), argv[2:]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the agent is not for the reaper
    groups: dict[int, int | None] = {}
    if _read_commands(groups):
        return 0
    _kill_groups(groups, agent_group)
    for _ in range(SWEEPS if os.path.isdir("/proc/self") else 0):
        found = leftovers(marker, spare_group=agent_group)
        if not found:
            break
        _kill(found, signal.SIGKILL)
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
