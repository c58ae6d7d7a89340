"""Mirror of torch's deprecated ``torch.distributed._tensor.experimental`` (the names of ``spmd.tensor.experimental``)."""

from spmd._mirror import missing_names
from spmd.tensor.experimental import MISSING, implicit_replication, local_map

__all__ = ["implicit_replication", "local_map"]

__getattr__ = missing_names("spmd.tensor.experimental", MISSING)
