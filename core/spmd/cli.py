"""The ``spmd`` command: ``spmd run``, ``spmd plugins``, ``spmd doctor``, ``spmd trace analyze``, ``spmd pipeline show``, ``spmd checkpoint``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from spmd import hookspecs, settings
from spmd.errors import SpmdError
from spmd.plugins import manager

#: The hooks whose results ``spmd plugins`` lists.
_LISTED_HOOKS: tuple[Callable[..., Any], ...] = (
    hookspecs.spmd_backends, hookspecs.spmd_strategies, hookspecs.spmd_schedules, hookspecs.spmd_storages,
    hookspecs.spmd_cluster_environments, hookspecs.spmd_rendezvous_backends, hookspecs.spmd_comm_hooks,
    hookspecs.spmd_sharding_rules,
)


def _provided() -> dict[str, dict[str, list[str]]]:
    """What every plugin contributes, per hook: each hook called once, through pluggy.

    A plugin whose hook raises is marked broken by the manager (and shown so).
    """
    pm = manager()
    provided: dict[str, dict[str, list[str]]] = {}
    for hook in _LISTED_HOOKS:
        for plugin, result in pm.results(hook):
            if hook is hookspecs.spmd_backends:
                label, names = "backends", [f"{s.name} ({', '.join(s.devices)})" for s in result]
            elif hook is hookspecs.spmd_sharding_rules:
                label, names = "sharding rules", [f"{len(result)} ops"]
            elif hook is hookspecs.spmd_comm_hooks:
                label, names = "comm hooks", sorted(result)
            else:
                label = hook.__name__.removeprefix("spmd_").replace("_", " ")
                names = [getattr(x, "name", getattr(x, "__name__", repr(x))) for x in result]
            provided.setdefault(plugin, {}).setdefault(label, []).extend(names)
    return provided


def cmd_plugins(args: argparse.Namespace) -> int:
    provided = _provided()  # first: a hook that raises marks its plugin broken
    infos = list(manager().infos.values())
    rows: list[dict[str, Any]] = []
    for info in infos:
        status = "blocked" if info.blocked else ("BROKEN" if info.error else "loaded")
        rows.append({
            "name": info.name,
            "distribution": info.distribution,
            "version": info.version,
            "builtin": info.builtin,
            "status": status,
            "error": info.error,
            "provides": provided.get(info.name, {}) if info.loaded else {},
        })
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for row in rows:
        kind = "builtin" if row["builtin"] else "plugin"
        print(f"{row['name']}  [{kind}] {row['distribution']} {row['version']}  {row['status']}")
        for what, names in row["provides"].items():
            print(f"    {what}: {', '.join(names)}")
        if row["error"]:
            print(f"    error: {row['error']}")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from spmd.comm.backend import COLLECTIVE_OPS
    from spmd.comm.registry import backends

    ok = True
    print("plugins:")
    for info in manager().infos.values():
        if info.blocked:
            print(f"  - {info.name}: blocked by SPMD_BLOCK_PLUGINS")
        elif info.error:
            ok = False
            print(f"  x {info.name} ({info.distribution} {info.version}): failed to load: {info.error}")
        else:
            print(f"  + {info.name} ({info.distribution} {info.version}): loaded")
    print("backends:")
    for entry in backends().entries():
        spec = entry.spec
        reason = spec.unavailable_reason()
        mark = "+" if reason is None else "x"
        state = "usable" if reason is None else f"NOT usable: {reason}"
        print(f"  {mark} {spec.name} [{', '.join(spec.devices)}] from {entry.plugin}, priority {spec.priority}: {state}")
        if spec.description:
            print(f"      {spec.description}")
        try:
            cls = spec.backend_type()
        except Exception as error:  # noqa: BLE001 - a broken class path is shown, not fatal
            print(f"      capabilities unknown: backend_class {spec.backend_class!r} does not import ({error})")
            continue
        if cls is None:
            print("      capabilities unknown: the spec names no backend_class")
            continue
        native = sorted(cls.native_ops())
        generic = [op for op in COLLECTIVE_OPS if op not in native and op != "split"]
        print(f"      native: {', '.join(native) or 'none'}; AVG: {'handled by the backend' if cls.supports_avg else 'run as SUM, then divided by the kernel'}")
        print(f"      generic (kernel algorithms over isend/irecv): {', '.join(generic) or 'none'}")
    from spmd.launch.environments import detect_launch

    detected = detect_launch()
    if detected is None:
        print("launch environment: none detected (plain process: spmd.init() runs a world of one)")
    else:
        env_name, launch = detected
        print(
            f"launch environment: {env_name} (rank {launch.rank} of {launch.world_size}, local rank "
            f"{launch.local_rank}, master {launch.master_addr}:{launch.master_port})"
        )
    _print_binding()
    # The one rule spmd.init() follows everywhere: the highest-priority usable backend per device.
    # A one-host backend (spmd-shm) is passed over for a group across hosts: both answers are shown.
    for device in backends().device_types():
        try:
            chosen = backends().for_device(device).spec.name
            spanning = backends().choose(device, lambda: True)
            across = spanning.entry.spec.name
            if across != chosen:
                chosen += f" for a group whose ranks share one host (asked through the job's store), else {across}"
            min_bytes = settings.current().hierarchical_min_bytes
            if spanning.passed_over is not None and min_bytes is not None:
                chosen += (f"; where a host holds 2+ of such a group's ranks, its all_reduce of {min_bytes} B and more is "
                           f"hierarchical: {spanning.passed_over.spec.name} inside each host, {across} between hosts "
                           "(SPMD_HIERARCHICAL_MIN_BYTES)")
        except Exception as error:  # noqa: BLE001 - reported
            chosen = f"none ({error})"
        usable = sorted(
            (e.spec for e in backends().entries() if device in e.spec.devices and e.spec.unavailable_reason() is None),
            key=lambda spec: -spec.priority,
        )
        order = ", ".join(f"{spec.name} {spec.priority}" for spec in usable)
        print(f"default for {device}: {chosen}" + (f" (highest priority of the usable: {order})" if order else ""))
    return 0 if ok else 1


def _print_binding() -> None:
    """Where each backend binds on this node, and why (the job's store, SPMD_SOCKET_IFNAME, a backend's own variable)."""
    from spmd.comm.address import binding_towards
    from spmd.comm.registry import backends
    from spmd.errors import SpmdError
    from spmd.world import job_store_endpoint

    endpoint = job_store_endpoint()
    try:
        binding = binding_towards(*endpoint) if endpoint else binding_towards("127.0.0.1", 0)
    except SpmdError as error:
        print(f"network: {error}")
        return
    where = f"the job's store at {endpoint[0]}:{endpoint[1]}" if endpoint else "no job store in this environment (as on one host)"
    print(f"network: {where}; this node: {binding.address or 'default'}"
          + (f" on {binding.interface}" if binding.interface else "") + f" ({binding.reason})")
    for entry in backends().entries():
        spec = entry.spec
        if spec.where_it_binds is None or spec.unavailable_reason() is not None:
            continue
        try:
            print(f"  {spec.name} binds to: {spec.where_it_binds(binding)}")
        except Exception as error:  # noqa: BLE001 - a broken description is shown, not fatal
            print(f"  {spec.name} binds to: unknown ({type(error).__name__}: {error})")


def _bench_threads(value: str) -> int | None:
    """``--threads``: a positive count, or ``default`` (None: torch's own thread count)."""
    if value == "default":
        return None
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is neither a positive thread count nor 'default'")
    return int(value)


def cmd_bench_collectives(args: argparse.Namespace) -> int:
    from spmd.bench import report, runner
    from spmd.bench.ops import OPS
    from spmd.bench.timing import size_sweep

    names = args.backend.split(",") if args.backend else runner.installed_runnable()
    ops = args.ops.split(",") if args.ops else list(OPS)
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        print(f"spmd bench: unknown ops {unknown}; choose from {', '.join(OPS)}", file=sys.stderr)
        return 2
    sizes = [int(x) for x in args.sizes.split(",")] if args.sizes else size_sweep(args.min_bytes, args.max_bytes, args.step_factor)
    rows: list[dict[str, Any]] = []
    skipped = {}
    for name in names:
        try:
            rows += runner.run_backend(name, args.nproc, ops, sizes, args.budget, args.vs_raw, not args.json, args.timeout, args.threads)
        except Exception as error:  # noqa: BLE001 - one backend failing must not hide the others
            skipped[name] = str(error)
            print(f"spmd bench: skipping {name}: {error}", file=sys.stderr)
    rows = report.enrich(rows)
    if args.json:
        print(json.dumps({"rows": rows, "skipped": skipped}, indent=1))
    else:
        print(report.tables(rows, names))
    if args.csv:
        with open(args.csv, "w") as f:
            f.write(report.to_csv(rows))
    if args.plot and rows:
        report.plot(rows, args.plot)
        if not args.json:
            print(f"\nplot written to {args.plot}")
    return 0 if rows else 1


def cmd_trace_analyze(args: argparse.Namespace) -> int:
    from spmd.debug import analyze

    try:
        result = analyze.analyze(analyze.load(args.directory))
    except (FileNotFoundError, ValueError) as error:
        print(f"spmd trace analyze: {error}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=1) if args.json else analyze.render(result))
    return 0


def cmd_checkpoint(args: argparse.Namespace) -> int:
    from spmd.checkpoint import CheckpointError, tools

    try:
        if args.checkpoint_command in ("inspect", "consolidate") and os.path.isfile(args.path):
            raise CheckpointError(
                f"{args.path!r} is a file, not a checkpoint directory (spmd checkpoints are directories of "
                f"metadata.json and safetensors files); a torch.save'd state dict converts with "
                f"`spmd checkpoint import-torch {args.path} DIR`"
            )
        if args.checkpoint_command == "inspect":
            meta, table = tools.inspect(args.path)
            print(json.dumps(json.loads(meta.to_json()), indent=1) if args.json else table)
        elif args.checkpoint_command == "consolidate":
            count = tools.consolidate(args.path, args.out)
            print(f"wrote {count} full tensors to {args.out}")
        else:
            print(f"spmd checkpoint import-torch: unpickling {args.file} (torch.load, weights_only=True); "
                  "the checkpoint it writes holds no pickle", file=sys.stderr)
            state = tools.import_torch(args.file, args.path)
            print(f"wrote {len(state)} top-level entries to {args.path}")
    except (CheckpointError, OSError, ValueError) as error:  # one line, no traceback: the message says what to do
        print(f"spmd checkpoint {args.checkpoint_command}: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from spmd.launch import agent
    from spmd.launch.args import accepted_notes, to_config

    for note in accepted_notes(args):
        print(f"spmd run: {note}", file=sys.stderr, flush=True)
    return agent.run(to_config(args))


def cmd_pipeline_show(args: argparse.Namespace) -> int:
    from spmd.pipeline import get_schedule, simulate
    from spmd.pipeline.show import ascii_timeline, save_picture

    cls = get_schedule(args.schedule)
    v = args.stages_per_rank or cls.stages_per_rank
    programs = cls.programs(args.stages * v, v, args.microbatches)
    costs = {"F": args.f, "B": args.b, "W": args.w}
    sim = simulate(programs, costs)
    print(f"{args.schedule}: {args.stages} ranks x {v} stage(s), {args.microbatches} microbatches, costs F={args.f:g} B={args.b:g} W={args.w:g}")
    print(ascii_timeline(sim, unit=min(c for c in costs.values() if c > 0)))
    if args.png:
        save_picture(sim, args.png, args.schedule)
        print(f"wrote {args.png}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from spmd import __version__

    parser = argparse.ArgumentParser(prog="spmd", description="spmd: backend-agnostic distributed training for PyTorch")
    parser.add_argument("--version", action="version", version=f"spmd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    plugins = sub.add_parser("plugins", help="list installed plugins and what each provides")
    plugins.add_argument("--json", action="store_true", help="machine-readable output")
    plugins.set_defaults(func=cmd_plugins)
    doctor = sub.add_parser("doctor", help="check that plugins load and backends can run here")
    doctor.set_defaults(func=cmd_doctor)
    from spmd.launch.args import build_parser

    bench = sub.add_parser("bench", help="nccl-tests-style benchmarks of every backend")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    coll = bench_sub.add_parser("collectives", help="time each collective over a size sweep, per backend, side by side")
    coll.add_argument("--backend", default=None, help="comma-separated backends (default: every installed one usable here)")
    coll.add_argument("--ops", default=None, help="comma-separated ops (default: all_reduce, all_gather_into_tensor, reduce_scatter_tensor, broadcast, all_to_all_single, sendrecv)")
    coll.add_argument("--nproc", type=int, default=2, help="ranks to launch (ignored inside spmd run/mpiexec)")
    coll.add_argument("--min-bytes", type=int, default=4)
    coll.add_argument("--max-bytes", type=int, default=64 << 20)
    coll.add_argument("--step-factor", type=int, default=4, help="size multiplier between steps (2 doubles)")
    coll.add_argument("--sizes", default=None, help="explicit comma-separated sizes in bytes (overrides the sweep)")
    coll.add_argument("--budget", type=float, default=0.04, help="seconds of measuring per op, size and backend")
    coll.add_argument("--vs-raw", action="store_true", help="also time the raw library beneath, alternating, and print spmd/raw")
    coll.add_argument("--json", action="store_true", help="print JSON only (no progress, no tables)")
    coll.add_argument("--csv", default=None, metavar="FILE", help="also write the rows as CSV")
    coll.add_argument("--plot", default=None, metavar="PNG", help="draw bus bandwidth against size (needs matplotlib)")
    coll.add_argument("--timeout", type=float, default=600.0, help="seconds per backend before giving up")
    coll.add_argument("--threads", type=_bench_threads, default=1, metavar="N|default",
                      help="torch threads per rank (default 1); 'default' leaves OMP_NUM_THREADS unset and torch at a "
                           "thread per core, as a launcher that sets neither (measures oversubscription)")
    coll.set_defaults(func=cmd_bench_collectives)
    trace = sub.add_parser("trace", help="flight-recorder dumps")
    trace_sub = trace.add_subparsers(dest="trace_command", required=True)
    analyze = trace_sub.add_parser("analyze", help="say who is stuck where, from every rank's dump")
    analyze.add_argument("directory", help="the job's SPMD_TRACE_DIR")
    analyze.add_argument("--json", action="store_true", help="machine-readable output")
    analyze.set_defaults(func=cmd_trace_analyze)
    pipeline = sub.add_parser("pipeline", help="pipeline schedules")
    pipeline_sub = pipeline.add_subparsers(dest="pipeline_command", required=True)
    show = pipeline_sub.add_parser("show", help="simulate a schedule and print its timeline")
    show.add_argument("schedule", help="a registered schedule (gpipe, 1f1b, interleaved_1f1b, zb_h1, ...)")
    show.add_argument("--stages", type=int, required=True, help="pipeline ranks P")
    show.add_argument("--microbatches", type=int, required=True, help="microbatches M")
    show.add_argument("--stages-per-rank", type=int, default=None, help="stages per rank (default: the schedule's)")
    show.add_argument("--f", type=float, default=1.0, help="cost of a forward")
    show.add_argument("--b", type=float, default=1.0, help="cost of a backward (input gradient when W is split off)")
    show.add_argument("--w", type=float, default=1.0, help="cost of a weight-gradient step")
    show.add_argument("--png", default=None, metavar="FILE", help="also draw the timeline (needs matplotlib)")
    show.set_defaults(func=cmd_pipeline_show)

    ckpt = sub.add_parser("checkpoint", help="inspect, consolidate or import distributed checkpoints")
    ckpt_sub = ckpt.add_subparsers(dest="checkpoint_command", required=True)
    inspect = ckpt_sub.add_parser("inspect", help="a table of the stored tensors (shapes, dtypes, placements, sizes) and values")
    inspect.add_argument("path", help="checkpoint directory or URL")
    inspect.add_argument("--json", action="store_true", help="print the metadata as JSON")
    consolidate = ckpt_sub.add_parser("consolidate", help="write one ordinary safetensors file of full tensors")
    consolidate.add_argument("path", help="checkpoint directory or URL")
    consolidate.add_argument("out", help="the .safetensors file to write")
    importer = ckpt_sub.add_parser("import-torch", help="convert a torch.save'd state dict (unpickles it, once)")
    importer.add_argument("file", help="the .pt file")
    importer.add_argument("path", help="the checkpoint directory or URL to write")
    ckpt.set_defaults(func=cmd_checkpoint)
    run = sub.add_parser("run", help="launch a training script on N workers per node (torchrun's flags)")
    build_parser(run)
    run.set_defaults(func=cmd_run)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # name the subcommand's usage, not the top level's
        (run if args.command == "run" else parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return int(args.func(args))
    except SpmdError as error:  # a known error is one line with what exists, not a traceback
        print(f"spmd {args.command}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
