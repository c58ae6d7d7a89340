"""``visualize_sharding``: which rank holds which block of a DTensor, as a text table (torch's debug helper)."""

from __future__ import annotations

import itertools

from spmd.tensor.dtensor import DTensor
from spmd.tensor.spec import local_shape_and_offset


def sharding_table(dtensor: DTensor) -> list[tuple[str, list[int]]]:
    """``[(block, ranks)]``: every distinct block of the global tensor (``"0:2, 0:4"``) and the ranks holding it."""
    spec = dtensor._spec
    mesh = spec.mesh
    blocks: dict[str, list[int]] = {}
    for coordinate in itertools.product(*(range(n) for n in mesh.shape)):
        sizes, offsets = local_shape_and_offset(spec.shape, mesh, spec.placements, list(coordinate))
        block = ", ".join(f"{o}:{o + n}" for o, n in zip(offsets, sizes)) or "scalar"
        blocks.setdefault(block, []).append(int(mesh.mesh[coordinate]))
    return list(blocks.items())


def visualize_sharding(dtensor: DTensor, header: str = "", use_rich: bool = False) -> None:
    """Print, on the mesh's first rank, each block of ``dtensor`` and the ranks that hold it (``use_rich`` is
    accepted for torch's signature; the table is plain text). Partial placements hold summands of every block."""
    mesh = dtensor._spec.mesh
    if mesh.get_coordinate() != [0] * mesh.ndim:
        return
    rows = sharding_table(dtensor)
    width = max(len(block) for block, _ in rows)
    lines = [header] if header else []
    lines.append(f"{'block':{width}s}  ranks   ({list(dtensor.placements)} of {list(dtensor.shape)})")
    lines.extend(f"{block:{width}s}  {ranks}" for block, ranks in rows)
    print("\n".join(lines))
