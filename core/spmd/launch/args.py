"""The ``spmd run`` command line: torchrun's flags, with torchrun's meaning."""

from __future__ import annotations

import argparse
import os
import signal
from dataclasses import dataclass

from spmd import settings
from spmd.errors import SettingError

#: Of each temp --tee log file (no --log-dir), the MiB kept: the newest output (SPMD_RUN_TEMP_LOG_MIB overrides).
TEMP_LOG_MIB = 16

#: torchrun's backend names and what serves them here.
ALIASES = {"static": "c10d", "etcd-v2": "etcd"}


@dataclass(frozen=True)
class RunConfig:
    """Everything ``spmd run`` was asked to do, parsed and validated."""

    nproc_per_node: int
    min_nodes: int
    max_nodes: int
    node_rank: int | None
    rdzv_endpoint: str | None
    rdzv_id: str
    standalone: bool
    max_restarts: int
    monitor_interval: float
    redirects: dict[int, int]
    tee: dict[int, int]
    log_dir: str | None
    module: bool
    no_python: bool
    script: str
    script_args: tuple[str, ...]
    rdzv_timeout: float
    last_call: float
    stop_grace: float
    master_addr: str | None = None  # what workers get as MASTER_ADDR (default: node 0's address)
    #: Signals the agent forwards to every worker before stopping the job (``--signals-to-handle``).
    signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
    rdzv_token: str | None = None  # the job token: the store's keys live under a namespace derived from it
    temp_log_bytes: int = TEMP_LOG_MIB << 20  # of each temp --tee log file (no --log-dir), the bytes kept
    rdzv_backend: str = "c10d"  # a spmd_rendezvous_backends name: c10d (an agent hosts the store) or etcd
    #: Every ``--rdzv-conf key=value`` (the backend reads its own: etcd's protocol, cacert, cert, key, user, password_file).
    rdzv_conf: tuple[tuple[str, str], ...] = ()


def _nodes(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    try:
        low, high = int(lo), int(hi) if sep else int(lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--nnodes {text!r}: write N or MIN:MAX, e.g. 2 or 1:4") from None
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"--nnodes {text!r}: need 1 <= MIN <= MAX")
    return low, high


def _streams(text: str, nproc: int, flag: str) -> dict[int, int]:
    """torchrun's ``0|1|2|3`` (none/stdout/stderr/both) or ``local_rank:value,...``."""
    try:
        if ":" not in text:
            value = int(text)
            return dict.fromkeys(range(nproc), value)
        mapping = {int(k): int(v) for k, v in (item.split(":") for item in text.split(","))}
    except ValueError:
        raise SystemExit(f"spmd run: {flag} {text!r}: use 0 (none), 1 (stdout), 2 (stderr), 3 (both), or e.g. 0:3,1:0") from None
    return {r: mapping.get(r, 0) for r in range(nproc)}


def _nproc(text: str) -> int:
    if text in ("auto", "gpu", "cpu"):
        if text != "cpu":
            try:
                import torch

                if torch.cuda.is_available() and torch.cuda.device_count() > 0:
                    return torch.cuda.device_count()
            except Exception:  # noqa: BLE001 - fall back to CPUs
                pass
        return os.cpu_count() or 1
    value = int(text)
    if value < 1:
        raise SystemExit(f"spmd run: --nproc-per-node {text!r} must be >= 1 or 'auto'")
    return value


#: torchrun flags that ``spmd run`` accepts and what each does here: flag -> (alias, metavar or None for a switch, note).
ACCEPTED: dict[str, tuple[str, str | None, str]] = {
    "--rdzv-conf": ("--rdzv_conf", "CONF", "join_timeout and last_call_timeout set --rdzv-timeout and --last-call; protocol, cacert, cert, key, user "
                   "and password_file secure --rdzv-backend etcd, worker_store=etcd keeps the workers' keys there too "
                   "(docs/rendezvous.md); other keys are ignored"),
    "--start-method": ("--start_method", "METHOD", "workers are always fresh processes (like spawn)"),
    "--event-log-handler": ("--event_log_handler", "HANDLER", "no event log; the agent reports to stderr"),
    "--role": ("--role", "ROLE", "no roles: every worker runs the same script"),
    "--run-path": ("--run_path", None, "the script runs as a file, which is what --run-path asks for"),
    "--local-ranks-filter": ("--local_ranks_filter", "RANKS", "ignored: every local rank's output is shown (use --tee/--redirects with --log-dir)"),
    "--duplicate-stdout-filters": ("--duplicate_stdout_filters", "FILTERS", "ignored: no duplicated filtered output files"),
    "--duplicate-stderr-filters": ("--duplicate_stderr_filters", "FILTERS", "ignored: no duplicated filtered output files"),
    "--local-addr": ("--local_addr", "ADDR", "ignored: the agent finds its address on the route to the rendezvous host"),
    "--logs-specs": ("--logs_specs", "SPECS", "ignored: logs go to --log-dir"),
    "--numa-binding": ("--numa_binding", "KIND", "ignored: no NUMA binding (use numactl in --no-python mode)"),
    "--virtual-local-rank": ("--virtual_local_rank", None, "ignored: LOCAL_RANK stays the worker's real local rank"),
}


def accepted_notes(ns: argparse.Namespace) -> list[str]:
    """One line for each accepted-but-inert torchrun flag that was given, saying what it does here."""
    notes = []
    for flag, (_, _, note) in ACCEPTED.items():
        if getattr(ns, flag.lstrip("-").replace("-", "_"), None) not in (None, False):
            notes.append(f"{flag}: {note}")
    return notes


def _signals(text: str) -> tuple[int, ...]:
    """``SIGTERM,SIGINT,...`` (names, with or without SIG, or numbers) as signal numbers."""
    found = []
    for item in (part.strip() for part in text.split(",") if part.strip()):
        name = item.upper() if item.upper().startswith("SIG") else f"SIG{item.upper()}"
        try:
            found.append(signal.Signals(int(item)) if item.isdigit() else signal.Signals[name])
        except (KeyError, ValueError):
            raise SystemExit(f"spmd run: --signals-to-handle: {item!r} is not a signal name (e.g. SIGTERM,SIGINT,SIGUSR1)") from None
        if found[-1] in (signal.SIGKILL, signal.SIGSTOP):
            raise SystemExit(f"spmd run: --signals-to-handle: {found[-1].name} cannot be handled")
    return tuple(found)


def _rdzv_conf(text: str | None) -> dict[str, str]:
    """torchrun's ``key=value,...`` as a dict (the timeouts are read here, the rest by the rendezvous backend)."""
    values: dict[str, str] = {}
    for item in (text or "").split(","):
        key, sep, value = item.partition("=")
        if sep:
            values[key.strip()] = value.strip()
    for key in ("join_timeout", "last_call_timeout"):
        if key in values:
            try:
                float(values[key])
            except ValueError:
                raise SystemExit(f"spmd run: --rdzv-conf {key}={values[key]}: write a number of seconds") from None
    return values


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``spmd run``'s flags to ``parser`` (torchrun's names; dashes or underscores)."""
    add = parser.add_argument
    add("--nproc-per-node", "--nproc_per_node", default="1", help="workers per node: a number, or auto (GPUs if any, else CPUs)")
    add("--nnodes", default="1", help="number of nodes: N, or MIN:MAX for elastic membership")
    add("--node-rank", "--node_rank", type=int, default=None, help="this node's rank (static); default: order of arrival")
    add("--rdzv-backend", "--rdzv_backend", default="c10d",
        help="where the agents meet: c10d (default; torchrun's static too: node 0's agent hosts a TCPStore at --rdzv-endpoint) "
        "or etcd (an etcd v3 cluster at --rdzv-endpoint that no agent hosts, so the job re-forms after losing any node)")
    add("--rdzv-endpoint", "--rdzv_endpoint", default=None,
        help="host:port of the rendezvous store (c10d: node 0's agent hosts it); etcd: its client URLs, host:port[,host:port...]")
    add("--rdzv-id", "--rdzv_id", default="none", help="job id: agents with the same id form one job")
    add("--rdzv-timeout", type=float, default=300.0, help="seconds to wait for MIN nodes at each rendezvous, and for the other nodes once this node's workers finished")
    add("--last-call", type=float, default=2.0, help="seconds to wait for more nodes once MIN arrived (elastic)")
    add("--rdzv-token", "--rdzv_token", default=None,
        help="job token (default: $SPMD_RDZV_TOKEN): the same on every node; without it nobody can read, write or stop the job's store keys")
    add("--standalone", action="store_true", help="single node: host a private rendezvous on a free port")
    add("--max-restarts", "--max_restarts", type=int, default=0, help="restarts of the whole group after a failure")
    add("--monitor-interval", "--monitor_interval", type=float, default=0.1, help="seconds between health checks")
    add("--redirects", "-r", default="0", help="send worker output only to --log-dir files: 0 none, 1 stdout, 2 stderr, 3 both")
    add("--tee", "-t", default="0", help="send worker output to --log-dir files and the console, prefixed by rank: 0-3")
    add("--log-dir", "--log_dir", default=None, help="where each run writes <rdzv-id>_<random>/attempt_N/<local rank>/{stdout,stderr}.log "
        "for --tee/--redirects (default: the system's temp directory, where --tee files keep their last $SPMD_RUN_TEMP_LOG_MIB "
        f"MiB, default {TEMP_LOG_MIB}, and are removed at exit unless --redirects wrote there too)")
    add("--stop-grace", type=float, default=3.0, help="seconds between SIGTERM and SIGKILL when stopping workers")
    add("--master-addr", "--master_addr", default=None, help="as torchrun's static rendezvous: without --rdzv-endpoint, agents meet at MASTER_ADDR:MASTER_PORT, and workers get MASTER_ADDR")
    add("--master-port", "--master_port", type=int, default=None, help="see --master-addr (workers' MASTER_PORT is a free port node 0 picks: the agents' store holds this one, as torchrun's does)")
    add("--shutdown-timeout", "--shutdown_timeout", type=float, default=None, help="torchrun's name for --stop-grace")
    add("--signals-to-handle", "--signals_to_handle", default="SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        help="signals the agent forwards to every worker (then SIGKILL after --stop-grace) and stops the job on; e.g. add SIGUSR1 for a checkpoint-before-timeout signal")
    for flag, (underscored, meta, note) in ACCEPTED.items():
        names = [flag] if underscored == flag else [flag, underscored]
        text = f"accepted for torchrun compatibility: {note}"
        if meta is None:
            add(*names, action="store_true", help=text)
        else:
            add(*names, metavar=meta, default=None, help=text)
    add("-m", "--module", action="store_true", help="run the script as a module (python -m)")
    add("--no-python", "--no_python", action="store_true", help="run the script as an executable, not with python")
    add("script", help="the training script (or module, or executable)")
    add("script_args", nargs=argparse.REMAINDER, help="arguments passed through to the script")
    _pet_defaults(parser)
    return parser


def _pet_defaults(parser: argparse.ArgumentParser) -> None:
    """torchrun's environment defaults: ``PET_<FLAG>`` stands for an omitted flag (what Kubeflow Trainer sets).

    E.g. PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT; a switch
    such as PET_STANDALONE is 1 or 0. A flag on the command line wins, as with torchrun.
    """
    for action in parser._actions:
        name = f"PET_{action.dest.upper()}"
        value = os.environ.get(name)
        if not action.option_strings or action.dest == "help" or value in (None, ""):
            continue
        if isinstance(action, argparse._StoreTrueAction):
            if value.strip() not in ("0", "1"):
                raise SystemExit(f"spmd run: {name}={value!r} stands for {action.option_strings[0]}: use 1 (on) or 0 (off)")
            action.default = value.strip() == "1"
        else:
            action.default = value  # a string: argparse converts it with the flag's type, as a typed value


def to_config(ns: argparse.Namespace) -> RunConfig:
    """Validate parsed arguments into a RunConfig."""
    try:
        settings.refresh()  # an entry point: the SPMD_* variables as they are now (spmd.settings)
    except SettingError as error:
        raise SystemExit(f"spmd run: {error}") from None
    low, high = _nodes(ns.nnodes)
    conf = _rdzv_conf(ns.rdzv_conf)
    nproc = _nproc(str(ns.nproc_per_node))
    if ns.module and ns.no_python:
        raise SystemExit("spmd run: -m and --no-python exclude each other")
    if ns.standalone and high > 1:
        raise SystemExit("spmd run: --standalone is for one node; drop it or use --nnodes 1")
    endpoint = ns.rdzv_endpoint
    if not endpoint and not ns.standalone and (ns.master_addr or ns.master_port):
        endpoint = f"{ns.master_addr or '127.0.0.1'}:{ns.master_port or 29500}"  # torchrun's static rendezvous
    if high > 1 and not endpoint:
        raise SystemExit("spmd run: with --nnodes > 1 pass --rdzv-endpoint host:port (the same on every node)")
    backend = canonical(ns.rdzv_backend)
    if backend != "c10d" and (ns.standalone or not ns.rdzv_endpoint):
        raise SystemExit(f"spmd run: --rdzv-backend {ns.rdzv_backend} meets at --rdzv-endpoint: pass its address "
                         "(for etcd, its client URLs host:port[,host:port...]); --standalone and --master-addr are for c10d")
    return RunConfig(
        nproc_per_node=nproc,
        min_nodes=low,
        max_nodes=high,
        node_rank=ns.node_rank,
        rdzv_endpoint=None if ns.standalone else endpoint,
        rdzv_id=ns.rdzv_id,
        standalone=ns.standalone or not endpoint,
        max_restarts=ns.max_restarts,
        monitor_interval=ns.monitor_interval,
        redirects=_streams(ns.redirects, nproc, "--redirects"),
        tee=_streams(ns.tee, nproc, "--tee"),
        log_dir=ns.log_dir,
        module=ns.module,
        no_python=ns.no_python,
        script=ns.script,
        script_args=tuple(ns.script_args),
        rdzv_timeout=float(conf.get("join_timeout", ns.rdzv_timeout)),
        last_call=float(conf.get("last_call_timeout", ns.last_call)),
        stop_grace=ns.stop_grace if ns.shutdown_timeout is None else ns.shutdown_timeout,
        master_addr=ns.master_addr,
        signals=_signals(ns.signals_to_handle),
        rdzv_token=ns.rdzv_token or settings.current().rdzv_token,
        temp_log_bytes=temp_log_bytes(),
        rdzv_backend=backend,
        rdzv_conf=tuple(conf.items()),
    )


def temp_log_bytes() -> int:
    """The bound on each temp --tee log file, from SPMD_RUN_TEMP_LOG_MIB (default TEMP_LOG_MIB)."""
    mib = settings.current().run_temp_log_mib
    return int((mib if mib is not None else TEMP_LOG_MIB) * 2**20)


def canonical(name: str | None) -> str:
    """The backend name ``--rdzv-backend`` means (torchrun's ``static`` is ``c10d``; none given: ``c10d``)."""
    name = (name or "c10d").strip().lower()
    return ALIASES.get(name, name)
