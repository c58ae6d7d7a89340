"""FSDP: ``fully_shard`` shards parameters per module, gathers them for compute, reduce-scatters gradients.

    from spmd.parallel import fully_shard, FSDPModule, MixedPrecisionPolicy

    with torch.device("meta"):
        model = Model()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)                      # isinstance(model, FSDPModule)
    model.to_empty(device="cpu")
    model.reset_parameters()                # or init_weights(): every rank computes the same values
    optimizer = torch.optim.AdamW(model.parameters())   # the parameters are DTensors

Modules: ``policy`` (MixedPrecisionPolicy, OffloadPolicy), ``layout`` (where
each parameter lies in the flat shard and the unsharded buffer), ``unit`` (one
module's shards and collectives, and adopting parameters replaced by
``to_empty``/``load_state_dict(assign=True)``), ``autograd`` (the backward
hooks), ``root`` (order, prefetching, pending reductions, end of backward),
``module`` (``FSDPModule``: the class ``fully_shard`` gives the module, as
torch does, so ``isinstance`` sees it), ``api`` (``fully_shard``), ``state_dict``
(full state dicts). ``spmd.parallel.clip_grad_norm_`` clips sharded gradients.
"""

from spmd.parallel.fsdp.api import fully_shard, is_fully_sharded
from spmd.parallel.fsdp.module import FSDPModule, UnshardHandle
from spmd.parallel.fsdp.policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from spmd.parallel.fsdp.state_dict import get_full_state_dict, load_full_state_dict

__all__ = [
    "CPUOffloadPolicy",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "fully_shard",
    "get_full_state_dict",
    "is_fully_sharded",
    "load_full_state_dict",
]
