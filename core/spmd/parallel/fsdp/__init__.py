"""FSDP: ``fully_shard`` shards parameters per module, gathers them for compute, reduce-scatters gradients.

    from spmd.parallel import fully_shard, MixedPrecisionPolicy

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters())   # the parameters are DTensors

Modules: ``policy`` (MixedPrecisionPolicy), ``layout`` (where each parameter
lies in the flat shard and the unsharded buffer), ``unit`` (one module's
shards and collectives), ``autograd`` (the backward hooks), ``root`` (order,
prefetching, pending reductions, end of backward), ``api`` (``fully_shard``),
``state_dict`` (full state dicts). ``spmd.parallel.clip_grad_norm_`` clips sharded gradients.
"""

from spmd.parallel.fsdp.api import UnshardHandle, fully_shard, is_fully_sharded
from spmd.parallel.fsdp.policy import MixedPrecisionPolicy
from spmd.parallel.fsdp.state_dict import get_full_state_dict, load_full_state_dict

__all__ = [
    "MixedPrecisionPolicy",
    "UnshardHandle",
    "fully_shard",
    "get_full_state_dict",
    "is_fully_sharded",
    "load_full_state_dict",
]
