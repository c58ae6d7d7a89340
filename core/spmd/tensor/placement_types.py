"""Mirror of ``torch.distributed.tensor.placement_types`` (home: ``spmd.tensor.placements``)."""

from spmd._mirror import missing_names
from spmd.tensor.placements import Partial, Placement, Replicate, Shard

__all__ = ["Partial", "Placement", "Replicate", "Shard"]

#: torch names spmd does not have yet -> the closest spmd way.
MISSING = {
    "_StridedShard": "nested Shard placements on the transposed mesh: fully_shard over tensor-parallel DTensors puts "
    "them on the mesh (tp, dp) with [Shard(d), Shard(d)], the layout torch spells _StridedShard (docs/fsdp.md)",
}

__getattr__ = missing_names(__name__, MISSING)
