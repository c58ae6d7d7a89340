"""``spmd trace analyze DIR``: read every rank's dump and say who is stuck where.

It finds, per group, the first sequence number that not every member
completed and what each member was doing there; the first sequence number at
which members called different ops (or shapes, dtypes, reduce ops); the
point-to-point ops still pending on each rank; and ranks with no dump at all.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spmd.debug.dump import dump_format_version
from spmd.debug.signatures import SHAPES_MAY_DIFFER


@dataclass
class GroupReport:
    name: str
    ranks: list[int]
    stuck_seq: int | None = None
    at_stuck: dict[int, str] = field(default_factory=dict)
    divergence: dict[str, Any] | None = None
    timeline: list[dict[str, Any]] = field(default_factory=list)


def load(directory: str | Path) -> dict[int, dict[str, Any]]:
    """Every ``rank<N>.json`` in ``directory``, by rank; rejects unknown format versions."""
    dumps = {}
    for path in sorted(Path(directory).glob("rank*.json")):
        data = json.loads(path.read_text())
        if int(data.get("version", 0)) > dump_format_version:
            raise ValueError(f"{path}: dump format version {data['version']} is newer than this spmd ({dump_format_version}); upgrade spmd")
        dumps[int(data["rank"])] = data
    if not dumps:
        raise FileNotFoundError(f"no rank*.json dumps in {directory}; set SPMD_TRACE_DIR for the job, or pass its value")
    return dumps


def _signature(entry: dict[str, Any]) -> str:
    """What the members' calls must share (as ``desync.comparable_signature``): the shapes, except for ops
    whose shapes may differ by rank (uneven all_to_all_single: only the shape of a row)."""
    if entry["op"] in SHAPES_MAY_DIFFER:
        row = entry["shapes"][0][1:] if entry["op"] == "all_to_all_single" and entry["shapes"] else []
        shapes = f"rows {'x'.join(map(str, row))}" if row else ""
    else:
        shapes = ";".join("x".join(map(str, s)) for s in entry["shapes"])
    reduce = f" {entry['reduce_op']}" if entry.get("reduce_op") else ""
    return f"{entry['op']}({','.join(entry['dtypes'])} [{shapes}]){reduce}"


def _state_mark(entry: dict[str, Any] | None) -> str:
    if entry is None:
        return "-"
    return {"completed": "ok", "started": "..", "failed": "FAILED", "scheduled": "queued"}.get(entry["state"], entry["state"])


#: A dump this many seconds older than the newest one is from another incident (an earlier run or attempt).
STALE_AFTER_S = 120.0


def _current(dumps: dict[int, dict[str, Any]]) -> tuple[dict[int, dict[str, Any]], dict[int, float]]:
    """The dumps of the newest incident, and the others (rank -> age in seconds against the newest).

    Dump directories persist across runs and restarts: a rank that died
    without dumping would otherwise be shown by its dump of an earlier hang.
    A dump is of the newest incident if it has the newest dump's run and
    restart, and was written within ``STALE_AFTER_S`` of it.
    """
    newest = max(dumps.values(), key=lambda d: d.get("time", 0.0))
    current, stale = {}, {}
    for rank, d in dumps.items():
        age = newest.get("time", 0.0) - d.get("time", 0.0)
        if d.get("run") != newest.get("run") or age > STALE_AFTER_S:
            stale[rank] = age
        else:
            current[rank] = d
    return current, stale


def analyze(dumps: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The analysis as plain data (what ``--json`` prints)."""
    dumps, stale = _current(dumps)
    world_size = max(d["world_size"] for d in dumps.values())
    groups: dict[str, list[int]] = {}
    for d in dumps.values():
        groups.update(d["groups"])
    by_rank_group: dict[int, dict[str, dict[int, dict[str, Any]]]] = {}
    p2p_pending: dict[int, list[str]] = {}
    for rank, d in dumps.items():
        per_group: dict[str, dict[int, dict[str, Any]]] = {}
        for e in d["entries"]:
            if e["seq"] < 0:
                if e["state"] in ("started", "failed"):
                    direction = "to" if e["op"] == "send" else "from"
                    p2p_pending.setdefault(rank, []).append(f"{e['op']} {direction} rank {e['peer']} on group {e['group']!r} ({_state_mark(e)})")
                continue
            per_group.setdefault(e["group"], {})[e["seq"]] = e
        by_rank_group[rank] = per_group
    reports = []
    for name, ranks in sorted(groups.items()):
        report = GroupReport(name, list(ranks))
        seqs = sorted({s for r in ranks if r in by_rank_group for s in by_rank_group[r].get(name, {})})
        if not seqs:
            continue
        # Below the newest of the members' oldest recorded ops, some member's ring has let the op go
        # (long done): a missing entry there is no evidence, so the search starts at that op.
        oldest = [min(by_rank_group[r][name]) for r in ranks if by_rank_group.get(r, {}).get(name)]
        seqs = [s for s in seqs if s >= max(oldest)]
        # first seq not completed by every member that has a dump (a missing dump counts as not completed)
        for s in seqs:
            states = [by_rank_group.get(r, {}).get(name, {}).get(s) for r in ranks]
            if any(e is None or e["state"] != "completed" for e in states):
                report.stuck_seq = s
                break
        # first seq where members disagree on the call
        for s in seqs:
            calls = {r: _signature(e) for r in ranks if (e := by_rank_group.get(r, {}).get(name, {}).get(s))}
            if len(set(calls.values())) > 1:
                report.divergence = {"seq": s, "calls": calls}
                break
        if report.stuck_seq is not None:
            for r in ranks:
                group_entries = by_rank_group.get(r, {}).get(name, {})
                e = group_entries.get(report.stuck_seq)
                if r not in dumps:
                    report.at_stuck[r] = "no dump from this rank (dead, or never asked)"
                elif e is None:
                    last = max(group_entries) if group_entries else None
                    where = f"last op #{last} {group_entries[last]['op']} ({_state_mark(group_entries[last])})" if last is not None else "no op on this group"
                    report.at_stuck[r] = f"never reached #{report.stuck_seq}; {where}"
                else:
                    report.at_stuck[r] = f"{_signature(e)} {_state_mark(e)}" + (f" — {e['error']}" if e.get("error") else "")
        window = seqs[-8:] if report.stuck_seq is None else [s for s in seqs if s >= report.stuck_seq - 3][:8]
        for s in window:
            row: dict[str, Any] = {"seq": s}
            for r in ranks:
                e = by_rank_group.get(r, {}).get(name, {}).get(s)
                row[str(r)] = f"{e['op']} {_state_mark(e)}" if e else "-"
            report.timeline.append(row)
        reports.append(report)
    return {
        "world_size": world_size,
        "ranks_with_dumps": sorted(dumps),
        "ranks_without_dumps": [r for r in range(world_size) if r not in dumps],
        "stale_dumps": {str(r): round(age, 1) for r, age in sorted(stale.items())},
        "groups": [r.__dict__ for r in reports],
        "p2p_pending": {str(k): v for k, v in p2p_pending.items()},
    }


def render(result: dict[str, Any]) -> str:
    """The analysis for people."""
    out = [f"world of {result['world_size']}: dumps from ranks {result['ranks_with_dumps']}"]
    if result["ranks_without_dumps"]:
        out.append(f"NO DUMP from ranks {result['ranks_without_dumps']} (dead, or the job ended before they could dump)")
    if result.get("stale_dumps"):
        ages = ", ".join(f"rank {r}: {age:.0f} s older" for r, age in result["stale_dumps"].items())
        out.append(f"left out as stale (another run or attempt, or an earlier hang): {ages}")
    for g in result["groups"]:
        out.append(f"\ngroup {g['name']!r} (ranks {g['ranks']}):")
        if g["stuck_seq"] is None:
            out.append("  every recorded op completed on every rank")
        else:
            out.append(f"  stuck at #{g['stuck_seq']}:")
            out += [f"    rank {r}: {what}" for r, what in g["at_stuck"].items()]
        if g["divergence"]:
            d = g["divergence"]
            out.append(f"  first divergence at #{d['seq']}: ranks called different ops")
            out += [f"    rank {r}: {call}" for r, call in d["calls"].items()]
        if g["timeline"]:
            ranks = g["ranks"]
            out.append("  timeline:  seq | " + " | ".join(f"rank {r}" for r in ranks))
            for row in g["timeline"]:
                out.append(f"            {row['seq']:>3} | " + " | ".join(row[str(r)] for r in ranks))
    for rank, ops in result["p2p_pending"].items():
        out.append(f"\nrank {rank} point-to-point not completed: " + "; ".join(ops))
    return "\n".join(out)
