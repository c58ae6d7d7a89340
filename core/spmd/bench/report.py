"""Tables for people, CSV and JSON for machines, and a bandwidth plot."""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from typing import Any

from spmd.bench.timing import bus_factor


def human(n: int) -> str:
    """A byte count as people read it, rounded down: ``human(65536) == "64 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}"
        n //= 1024
    return str(n)


def enrich(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Add algbw and busbw (GB/s) to each row."""
    out = []
    for row in rows:
        algbw = row["bytes"] / row["median_s"] / 1e9
        out.append({**row, "algbw_gbs": algbw, "busbw_gbs": algbw * bus_factor(row["op"], row["world_size"])})
    return out


def tables(rows: Sequence[dict[str, Any]], backends: Sequence[str]) -> str:
    """One table per op; a block of columns per backend; time relative to the first backend.

    ``median`` is back to back; ``after work`` the median of calls made after a barrier and 1 ms idle;
    ``of copy_`` the algorithm bandwidth as a fraction of a one-process ``copy_`` of the same size
    measured in the same run (memory's speed on this machine: 1.0 is a collective as fast as a copy).
    """
    lines = []
    ops = list(dict.fromkeys(r["op"] for r in rows))
    index = {(r["backend"], r["op"], r["bytes"]): r for r in rows}
    present = [b for b in backends if any(r["backend"] == b for r in rows)]
    for op in ops:
        sizes = sorted({r["bytes"] for r in rows if r["op"] == op})
        world = next(r["world_size"] for r in rows if r["op"] == op)
        threads = sorted({r["threads"] for r in rows if r["op"] == op and "threads" in r})
        each = f", {'/'.join(map(str, threads))} torch thread{'s' if threads != [1] else ''} each" if threads else ""
        lines.append(f"\n{op}  ({world} ranks{each}; busbw factor {bus_factor(op, world):.3g}; times in us, bandwidths in GB/s)")
        header = f"{'size':>9}"
        for i, b in enumerate(present):
            header += f" | {b + ' median':>14} {'min':>8} {'max':>8} {'algbw':>7} {'busbw':>7} {'after work':>10} {'of copy_':>8}"
            if i:
                header += f" {'x ' + present[0]:>9}"
            if any("raw_median_s" in r for r in rows if r["backend"] == b):
                header += f" {'raw':>9} {'spmd/raw':>8}"
        lines.append(header)
        for size in sizes:
            line = f"{human(size):>9}"
            first = index.get((present[0], op, size))
            for i, b in enumerate(present):
                r = index.get((b, op, size))
                if r is None:
                    line += " | " + "-".rjust(14) + " " * 56
                    continue
                line += f" | {r['median_s'] * 1e6:14.1f} {r['min_s'] * 1e6:8.1f} {r['max_s'] * 1e6:8.1f} {r['algbw_gbs']:7.3f} {r['busbw_gbs']:7.3f}"
                after = r.get("after_work_median_s")
                line += f" {after * 1e6:10.1f}" if after is not None else " " * 11
                copy = r.get("copy_median_s")
                line += f" {copy / r['median_s']:8.3f}" if copy else " " * 9
                if i:
                    line += f" {r['median_s'] / first['median_s']:9.3f}" if first else " " * 10
                if "raw_median_s" in r:
                    line += f" {r['raw_median_s'] * 1e6:9.1f} {r['ratio_vs_raw']:8.3f}"
            lines.append(line)
    return "\n".join(lines)


def to_csv(rows: Sequence[dict[str, Any]]) -> str:
    buffer = io.StringIO()
    fields = ["backend", "op", "bytes", "world_size", "threads", "median_s", "min_s", "max_s", "n", "algbw_gbs", "busbw_gbs", "after_work_median_s", "copy_median_s", "raw_median_s", "ratio_vs_raw"]
    writer = csv.DictWriter(buffer, fieldnames=fields, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def plot(rows: Sequence[dict[str, Any]], path: str) -> None:
    """busbw against size, one subplot per op, one line per backend (and its raw peer, dashed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise SystemExit("spmd bench --plot needs matplotlib: pip install 'spmd[bench]'") from error
    ops = list(dict.fromkeys(r["op"] for r in rows))
    cols = min(3, len(ops))
    nrows = (len(ops) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(5.5 * cols, 4 * nrows), squeeze=False)
    for ax, op in zip(axes.flat, ops):
        for backend in dict.fromkeys(r["backend"] for r in rows):
            pts = sorted((r["bytes"], r["busbw_gbs"], r.get("raw_median_s")) for r in rows if r["op"] == op and r["backend"] == backend)
            if not pts:
                continue
            line = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label=f"spmd-{backend}")[0]
            if any(p[2] for p in pts):
                bus = bus_factor(op, next(r["world_size"] for r in rows if r["op"] == op))
                ax.plot([p[0] for p in pts if p[2]], [p[0] / p[2] / 1e9 * bus for p in pts if p[2]], linestyle="--", color=line.get_color(), label=f"raw {backend}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(op)
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel("bus bandwidth (GB/s)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(ops):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
