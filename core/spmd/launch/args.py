"""The ``spmd run`` command line: torchrun's flags, with torchrun's meaning."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass


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


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``spmd run``'s flags to ``parser`` (torchrun's names; dashes or underscores)."""
    add = parser.add_argument
    add("--nproc-per-node", "--nproc_per_node", default="1", help="workers per node: a number, or auto (GPUs if any, else CPUs)")
    add("--nnodes", default="1", help="number of nodes: N, or MIN:MAX for elastic membership")
    add("--node-rank", "--node_rank", type=int, default=None, help="this node's rank (static); default: order of arrival")
    add("--rdzv-endpoint", "--rdzv_endpoint", default=None, help="host:port of the rendezvous store (one agent hosts it)")
    add("--rdzv-id", "--rdzv_id", default="none", help="job id: agents with the same id form one job")
    add("--rdzv-timeout", type=float, default=300.0, help="seconds to wait for MIN nodes at each rendezvous")
    add("--last-call", type=float, default=2.0, help="seconds to wait for more nodes once MIN arrived (elastic)")
    add("--standalone", action="store_true", help="single node: host a private rendezvous on a free port")
    add("--max-restarts", "--max_restarts", type=int, default=0, help="restarts of the whole group after a failure")
    add("--monitor-interval", "--monitor_interval", type=float, default=0.1, help="seconds between health checks")
    add("--redirects", "-r", default="0", help="send worker output only to --log-dir files: 0 none, 1 stdout, 2 stderr, 3 both")
    add("--tee", "-t", default="0", help="send worker output to --log-dir files and the console, prefixed by rank: 0-3")
    add("--log-dir", "--log_dir", default=None, help="directory for per-rank stdout/stderr logs")
    add("--stop-grace", type=float, default=3.0, help="seconds between SIGTERM and SIGKILL when stopping workers")
    add("-m", "--module", action="store_true", help="run the script as a module (python -m)")
    add("--no-python", "--no_python", action="store_true", help="run the script as an executable, not with python")
    add("script", help="the training script (or module, or executable)")
    add("script_args", nargs=argparse.REMAINDER, help="arguments passed through to the script")
    return parser


def to_config(ns: argparse.Namespace) -> RunConfig:
    """Validate parsed arguments into a RunConfig."""
    low, high = _nodes(ns.nnodes)
    nproc = _nproc(str(ns.nproc_per_node))
    if ns.module and ns.no_python:
        raise SystemExit("spmd run: -m and --no-python exclude each other")
    if ns.standalone and high > 1:
        raise SystemExit("spmd run: --standalone is for one node; drop it or use --nnodes 1")
    if high > 1 and not ns.rdzv_endpoint:
        raise SystemExit("spmd run: with --nnodes > 1 pass --rdzv-endpoint host:port (the same on every node)")
    if (ns.redirects != "0" or ns.tee != "0") and not ns.log_dir and ns.redirects != "0":
        raise SystemExit("spmd run: --redirects needs --log-dir (where else would the output go?)")
    return RunConfig(
        nproc_per_node=nproc,
        min_nodes=low,
        max_nodes=high,
        node_rank=ns.node_rank,
        rdzv_endpoint=None if ns.standalone else ns.rdzv_endpoint,
        rdzv_id=ns.rdzv_id,
        standalone=ns.standalone or not ns.rdzv_endpoint,
        max_restarts=ns.max_restarts,
        monitor_interval=ns.monitor_interval,
        redirects=_streams(ns.redirects, nproc, "--redirects"),
        tee=_streams(ns.tee, nproc, "--tee"),
        log_dir=ns.log_dir,
        module=ns.module,
        no_python=ns.no_python,
        script=ns.script,
        script_args=tuple(ns.script_args),
        rdzv_timeout=ns.rdzv_timeout,
        last_call=ns.last_call,
        stop_grace=ns.stop_grace,
    )
