"""``spmd pipeline show``: a schedule's simulated timeline as ASCII (and optionally a picture)."""

from __future__ import annotations

from spmd.pipeline.actions import COMPUTE
from spmd.pipeline.simulate import Simulation

CELL = 4  # characters per time unit


def ascii_timeline(sim: Simulation, unit: float = 1.0) -> str:
    """One row per rank, one cell of ``CELL`` characters per ``unit`` of time: ``F3`` forward of microbatch 3, ``.`` idle.

    Cells name the microbatch, not the stage: stage s runs on rank s % ranks.
    """
    ranks = sorted(sim.busy)
    width = max(1, round(sim.makespan / unit))
    rows = {r: ["." + " " * (CELL - 1)] * width for r in ranks}
    for e in sim.timeline:
        if e.action.kind not in COMPUTE:
            continue
        a = e.action
        start, end = round(e.start / unit), max(round(e.end / unit), round(e.start / unit) + 1)
        label = f"{a.kind.value}{a.microbatch}"
        for t in range(start, min(end, width)):
            rows[e.rank][t] = label[:CELL].ljust(CELL)
    lines = [f"rank {r:<2}| " + "".join(rows[r]).rstrip() for r in ranks]
    lines.append(f"makespan {sim.makespan:g}, bubble {sim.bubble_fraction:.1%}, peak live activations "
                 + ", ".join(f"rank {r}: {n}" for r, n in sim.peak_activations.items()))
    return "\n".join(lines)


def save_picture(sim: Simulation, path: str, title: str) -> None:
    """Draw the timeline as a Gantt chart with matplotlib (F blue, B green, W orange)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"F": "tab:blue", "B": "tab:green", "W": "tab:orange"}
    ranks = sorted(sim.busy)
    fig, ax = plt.subplots(figsize=(max(6.0, sim.makespan * 0.4), 0.6 * len(ranks) + 1.2))
    for e in sim.timeline:
        if e.action.kind not in COMPUTE:
            continue
        ax.barh(e.rank, e.end - e.start, left=e.start, color=colors[e.action.kind.value], edgecolor="black")
        ax.text((e.start + e.end) / 2, e.rank, str(e.action.microbatch), ha="center", va="center", fontsize=7)
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("time")
    ax.set_title(f"{title}: bubble {sim.bubble_fraction:.1%}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
