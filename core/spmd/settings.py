"""spmd's own environment variables (``SPMD_*``), read into one typed ``Settings`` object.

``current()`` parses the environment the first time it is asked (in practice at
``import spmd``: the flight recorder sizes its ring then) and keeps the result;
``refresh()`` parses it again. The entry points that start something call
``refresh()`` so a variable set after ``import spmd`` still counts: building
the plugin manager, ``spmd.init`` and ``spmd run``'s argument parsing. A value a
setting does not accept raises ``SettingError`` naming the variable and what it
accepts. Launcher variables that are not spmd's (RANK, WORLD_SIZE, MASTER_ADDR,
TORCHELASTIC_*, SLURM_*) are read where they are used; the table of every
setting is in docs/settings.md.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from spmd.errors import SettingError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _flag(text: str) -> bool:
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise ValueError(text)


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(text)
    return value


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


def _bytes_or_off(text: str) -> int | None:
    if text.lower() == "off":  # ("0" is a size here: every all_reduce)
        return None
    return _count(text)


def _names(text: str) -> frozenset[str]:
    return frozenset(n.strip() for n in text.split(",") if n.strip())


@dataclass(frozen=True)
class Setting:
    """One variable: its name, the ``Settings`` field it fills, how it is parsed, and what it means."""

    variable: str
    field: str
    parse: Callable[[str], Any]
    accepts: str
    meaning: str


_FLAG = "1/0, true/false, yes/no or on/off"
_SECONDS = "seconds, a number above 0, e.g. 30"

#: Every setting, in the order docs/settings.md lists them.
SETTINGS: tuple[Setting, ...] = (
    Setting("SPMD_TIMEOUT", "timeout", _positive, _SECONDS,
            "default timeout of every blocking call when spmd.init(timeout=) is not given (unset: 10 minutes)"),
    Setting("SPMD_BACKEND", "backend", str, "a backend name or a per-device map, e.g. gloo or cpu:gloo,cuda:nccl",
            "the backend spmd.init() uses when the script names none (unset: the kernel's choice, see spmd doctor)"),
    Setting("SPMD_TORCH_INTEROP", "torch_interop", _flag, _FLAG,
            "whether spmd.init also makes torch.distributed's default group an spmd one (spmd.init(torch_interop=) wins)"),
    Setting("SPMD_TRACE_DIR", "trace_dir", str, "a directory path",
            "where flight-recorder dumps go, one rank<N>.json per rank (spmd.init(trace_dir=) sets it)"),
    Setting("SPMD_FLIGHT_RECORDER", "flight_recorder", _count, "a whole number of entries, 0 or more",
            "ring-buffer entries the flight recorder keeps per process; 0 turns recording off (read at import)"),
    Setting("SPMD_WATCHDOG", "watchdog", _flag, _FLAG,
            "whether each process runs the watchdog thread (progress publishing, dumps on request, hang reports)"),
    Setting("SPMD_WATCHDOG_INTERVAL", "watchdog_interval", _positive, _SECONDS,
            "seconds between the watchdog's progress publications"),
    Setting("SPMD_DESYNC_CHECK", "desync_check", _flag, _FLAG,
            "compare op, shapes, dtypes and reduce op across ranks before each collective (costs a store round trip)"),
    Setting("SPMD_HISTORY_CHECK", "history_check", _flag, _FLAG,
            "keep each group's recent calls for the always-on mismatch check (read at import)"),
    Setting("SPMD_HIERARCHICAL_MIN_BYTES", "hierarchical_min_bytes", _bytes_or_off, "a whole number of bytes, 0 or more, or off",
            "the kernel's choice for a group across hosts with 2+ ranks on a host: all_reduce of at least this many bytes "
            "runs shm inside each host and the network between hosts (off: every op over the network backend alone)"),
    Setting("SPMD_CHECKPOINT_CLAIM_TTL", "checkpoint_claim_ttl", _positive, _SECONDS,
            "seconds without a heartbeat after which a save claim held from another machine is taken over"),
    Setting("SPMD_SOCKET_IFNAME", "socket_ifname", str, "a network interface name, e.g. eth0",
            "the interface every backend binds to (unset: the one that reaches the job's store)"),
    Setting("SPMD_RDZV_TOKEN", "rdzv_token", str, "any text, the same on every node",
            "the job token (spmd run --rdzv-token): the job's store keys live under its hash"),
    Setting("SPMD_ETCD_PASSWORD", "etcd_password", str, "the password of the --rdzv-conf user=",
            "spmd run --rdzv-backend etcd: the etcd user's password (or --rdzv-conf password_file=; never on the command line)"),
    Setting("SPMD_PLUGINS", "plugins", _names, "plugin names separated by commas",
            "plugins to load even when SPMD_DISABLE_PLUGIN_AUTOLOAD is on"),
    Setting("SPMD_BLOCK_PLUGINS", "block_plugins", _names, "plugin names separated by commas",
            "plugins never to load (builtins too)"),
    Setting("SPMD_DISABLE_PLUGIN_AUTOLOAD", "disable_plugin_autoload", _flag, _FLAG,
            "load only the builtin plugins and those SPMD_PLUGINS names"),
    Setting("SPMD_RUN_TEMP_LOG_MIB", "run_temp_log_mib", _positive, "the MiB to keep of each temp --tee log file, e.g. 16",
            "spmd run: the bound on each temp --tee log file without --log-dir (unset: 16)"),
    Setting("SPMD_ETCD_BINARY", "etcd_binary", str, "the path of an executable etcd",
            "spmd.testing: the etcd binary the etcd rendezvous tests start"),
    Setting("SPMD_AGENT_STORE", "agent_store", str, "host:port",
            "set by spmd run for its workers: the agents' store, which the workers join"),
    Setting("SPMD_STORE_PREFIX", "store_prefix", str, "a store key prefix",
            "set by spmd run for its workers: the key prefix of this rendezvous round in the agents' store"),
    Setting("SPMD_RUN_ID", "run_id", str, "any text",
            "set by spmd run for its workers: the job's --rdzv-id (a save claim names it)"),
    Setting("SPMD_RESTART_COUNT", "restart_count", _count, "a whole number, 0 or more",
            "set by spmd run for its workers: how many times the job's workers were restarted"),
    Setting("SPMD_CONSOLE_IS_TERMINAL", "console_is_terminal", _flag, _FLAG,
            "set by spmd run for its workers: the agent's console is a terminal (spmd.launch.console)"),
)


@dataclass(frozen=True)
class Settings:
    """spmd's settings as the environment gave them; unset variables take these defaults."""

    timeout: float | None = None
    backend: str | None = None
    torch_interop: bool = True
    trace_dir: str = "spmd_traces"
    flight_recorder: int = 2000
    watchdog: bool = True
    watchdog_interval: float = 1.0
    desync_check: bool = False
    history_check: bool = True
    hierarchical_min_bytes: int | None = 64  # measured: benchmarks/hierarchical_across_hosts.py
    checkpoint_claim_ttl: float = 120.0
    socket_ifname: str | None = None
    rdzv_token: str | None = None
    etcd_password: str | None = None
    plugins: frozenset[str] = frozenset()
    block_plugins: frozenset[str] = frozenset()
    disable_plugin_autoload: bool = False
    run_temp_log_mib: float | None = None
    etcd_binary: str | None = None
    agent_store: str | None = None
    store_prefix: str = "spmd/job"
    run_id: str | None = None
    restart_count: int = 0
    console_is_terminal: bool = False


def from_environ(environ: Mapping[str, str] | None = None) -> Settings:
    """The settings ``environ`` (default: this process's environment) gives; an empty variable counts as unset."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for setting in SETTINGS:
        text = environ.get(setting.variable, "").strip()
        if not text:
            continue
        try:
            values[setting.field] = setting.parse(text)
        except ValueError:
            raise SettingError(f"{setting.variable}={text!r}: give {setting.accepts}, or unset it for the default "
                               f"({setting.variable}: {setting.meaning})") from None
    return Settings(**values)


_lock = threading.Lock()
_current: Settings | None = None


def current() -> Settings:
    """The settings as last read (read now if they never were)."""
    global _current
    if _current is None:
        with _lock:
            if _current is None:
                _current = from_environ()
    return _current


def at_import() -> Settings:
    """The settings for a module-level default: the defaults while a variable is malformed, so that
    ``import spmd`` never fails on one; ``spmd.init`` and ``spmd run`` read again and name it."""
    try:
        return current()
    except SettingError:
        return Settings()


def refresh() -> Settings:
    """Read the environment again and return the new settings."""
    global _current
    fresh = from_environ()
    with _lock:
        _current = fresh
    return fresh


def job_id() -> str:
    """This process's job as its launcher names it: ``SPMD_RUN_ID`` (spmd run), torchrun's run id or
    Slurm's job id; "" where none does. Names what a job leaves on shared resources (a checkpoint's
    claim, a shared-memory segment) so that operators can tell whose it is."""
    return current().run_id or os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("SLURM_JOB_ID") or ""
