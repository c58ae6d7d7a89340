"""Whether a tensor's stored chunks tile it exactly: every element in one chunk, none in two, none in none.

Per chunk, never per element: the chunks' boundaries cut the tensor into a
grid of cells (for spmd's layouts, one cell per chunk); the chunks must
cover cells adding up to the grid exactly, and mark every cell of it.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence

import torch

#: The most grid cells checked (a bool each); spmd's own layouts have one cell per chunk.
MAX_CELLS = 2**24


def tiling_problem(shape: Sequence[int], boxes: Sequence[tuple[Sequence[int], Sequence[int]]]) -> str | None:
    """Why ``boxes`` (offsets, sizes), each inside ``shape``, do not tile it exactly; None when they do."""
    filled = [(tuple(o), tuple(s)) for o, s in boxes if math.prod(s) > 0]
    total = math.prod(shape)
    stored = sum(math.prod(s) for _, s in filled)
    if stored < total:
        return f"its chunks hold {stored} of its {total} elements (a hole)"
    if stored > total:
        return f"its chunks hold {stored} elements for {total} (chunks overlap)"
    if len(filled) < 2:
        return None
    cuts = [sorted({0, n, *(o[d] for o, _ in filled), *(o[d] + s[d] for o, s in filled)}) for d, n in enumerate(shape)]
    grid = tuple(len(c) - 1 for c in cuts)
    cells = math.prod(grid)
    if cells > MAX_CELLS:
        return f"its {len(filled)} chunks cut it into {cells} cells, more than {MAX_CELLS} that are checked"
    spans = [
        tuple(slice(bisect_left(cut, o[d]), bisect_left(cut, o[d] + s[d])) for d, cut in enumerate(cuts))
        for o, s in filled
    ]
    if sum(math.prod(x.stop - x.start for x in span) for span in spans) != cells:
        return "its chunks overlap"  # equal volumes, so a cell in two chunks means another in none
    marked = torch.zeros(grid, dtype=torch.bool)
    for span in spans:
        marked[span] = True
    if not bool(marked.all()):
        return "its chunks overlap"
    return None
