"""Mirror of ``torch.distributed.tensor.experimental``: ``implicit_replication`` and ``local_map``.

Homes: the switch ``implicit_replication`` sets is read by the dispatcher
(``spmd.tensor.dispatch``); ``local_map`` lives in ``spmd.tensor.local_map``.
"""

from spmd._mirror import missing_names
from spmd.tensor.dispatch import implicit_replication
from spmd.tensor.local_map import local_map

__all__ = ["implicit_replication", "local_map"]

#: torch.distributed.tensor.experimental names spmd does not have yet -> the closest spmd way.
MISSING = {
    "context_parallel": "shard the sequence dimension yourself: spmd.tensor.parallel.SequenceParallel for norms and "
    "dropout, or a ring of spmd.isend/irecv inside attention (no ring attention ships with spmd yet)",
    "register_sharding": "a sharding rule plugin: return {op: rule} from an spmd_sharding_rules hook (docs/dtensor.md; "
    "spmd.tensor.Rule, Sharding, pointwise_rule, ...)",
}

__getattr__ = missing_names(__name__, MISSING)
