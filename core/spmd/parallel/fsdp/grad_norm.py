"""clip_grad_norm_ for sharded gradients: one all-reduce of a scalar instead of gathering every gradient."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from spmd.comm import collectives
from spmd.comm.reduce_op import ReduceOp
from spmd.tensor.dtensor import DTensor
from spmd.tensor.placements import Shard


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale the gradients in place so their global ``norm_type`` norm is at most ``max_norm``; return the norm.

    ``torch.nn.utils.clip_grad_norm_`` also works on FSDP's DTensor gradients,
    but through DTensor's fallback (every gradient gathered in full). This sums
    each rank's local ``|g|^p`` and all-reduces that one scalar over the mesh
    dimensions the gradients are sharded on (HSDP replicas hold equal shards).
    Only finite ``norm_type`` (not inf).
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    local = torch.zeros((), dtype=torch.float64)
    groups: dict[tuple[int, ...], Any] = {}
    for g in grads:
        if isinstance(g, DTensor):
            part = g._local_tensor
            for mesh_dim, placement in enumerate(g.placements):
                if isinstance(placement, Shard):
                    group = g.device_mesh.get_group(mesh_dim)
                    groups[tuple(group.ranks)] = group  # one reduction per set of ranks
        else:
            part = g
        local += part.double().abs().pow(norm_type).sum()
    for group in groups.values():  # plain gradients are the same on every rank: FSDP gives only DTensors
        collectives.all_reduce(local, op=ReduceOp.SUM, group=group)
    total = local.pow(1.0 / norm_type).float()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        target = g._local_tensor if isinstance(g, DTensor) else g
        target.mul_(coef.to(target.dtype))
    return total
