"""clip_grad_norm_ for sharded gradients: one all-reduce of a scalar instead of gathering every gradient."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from spmd.comm import collectives
from spmd.comm.reduce_op import ReduceOp
from spmd.tensor.dtensor import DTensor
from spmd.tensor.placements import Partial, Replicate, Shard


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale the gradients in place so their global ``norm_type`` norm is at most ``max_norm``; return the norm.

    ``torch.nn.utils.clip_grad_norm_`` also works on FSDP's DTensor gradients,
    but through DTensor's fallback (every gradient gathered in full). This sums
    each rank's local ``|g|^p`` per set of sharding groups and all-reduces those
    scalars over the groups the gradients are sharded on (replicas hold equal
    shards), so plain, replicated, FSDP- and TP-sharded gradients mix freely.
    ``norm_type=inf`` takes the largest ``|g|`` instead, with MAX all-reduces.
    """
    norm_type = float(norm_type)
    infinite = norm_type == math.inf
    if not infinite and not (math.isfinite(norm_type) and norm_type > 0):
        raise ValueError(f"clip_grad_norm_: norm_type={norm_type} is not supported; use a positive number or inf")
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    # One partial sum per set of sharding groups: a gradient sharded over groups A and B counts once
    # after all-reducing over A and B; a plain or replicated gradient is whole on every rank already.
    sums: dict[tuple[tuple[int, ...], ...], torch.Tensor] = {}
    groups: dict[tuple[int, ...], Any] = {}
    for g in grads:
        key: tuple[tuple[int, ...], ...] = ()
        if isinstance(g, DTensor):
            if any(isinstance(p, Partial) for p in g.placements):  # |g|^p of a summand is not a summand of |g|^p
                g = g.redistribute(g.device_mesh, [Replicate() if isinstance(p, Partial) else p for p in g.placements])
            part = g._local_tensor
            for mesh_dim, placement in enumerate(g.placements):
                if isinstance(placement, Shard):
                    group = g.device_mesh.get_group(mesh_dim)
                    groups[tuple(group.ranks)] = group
                    key += (tuple(group.ranks),)
        else:
            part = g
        if infinite:
            term = part.double().abs().amax() if part.numel() else torch.zeros((), dtype=torch.float64)
            sums[key] = torch.maximum(sums[key], term) if key in sums else term
        else:
            term = part.double().abs().pow(norm_type).sum()
            sums[key] = sums[key] + term if key in sums else term
    total_pow = torch.zeros((), dtype=torch.float64)
    for key, value in sums.items():
        for ranks in key:  # one scalar all-reduce per group a set of gradients is sharded over
            collectives.all_reduce(value, op=ReduceOp.MAX if infinite else ReduceOp.SUM, group=groups[ranks])
        total_pow = torch.maximum(total_pow, value) if infinite else total_pow + value
    total = (total_pow if infinite else total_pow.pow(1.0 / norm_type)).float()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        target = g._local_tensor if isinstance(g, DTensor) else g
        target.mul_(coef.to(target.dtype))
    return total
