"""spmd.tensor: placements, DTensor, redistribution and the sharding-rule contract.

Mirrors ``torch.distributed.tensor``: a torch script ports by changing its imports.
"""

from spmd.tensor.debug import CommDebugMode
from spmd.tensor.dtensor import DTensor, distribute_tensor
from spmd.tensor.placements import Partial, Placement, Replicate, Shard
from spmd.tensor.rule import (
    Decompose,
    LocalInfo,
    OpCall,
    Rule,
    Sharding,
    TensorArg,
    TensorMeta,
    linear_pointwise_rule,
    pointwise_rule,
    replicate_rule,
)

__all__ = [
    "CommDebugMode",
    "DTensor",
    "Decompose",
    "LocalInfo",
    "OpCall",
    "Partial",
    "Placement",
    "Replicate",
    "Rule",
    "Shard",
    "Sharding",
    "TensorArg",
    "TensorMeta",
    "distribute_tensor",
    "linear_pointwise_rule",
    "pointwise_rule",
    "replicate_rule",
]
