"""Rank functions for test_fsdp.py: FSDP training against a single-process reference on the whole batch."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import spmd
from spmd.parallel import (
    MixedPrecisionPolicy,
    clip_grad_norm_,
    fully_shard,
    get_full_state_dict,
    load_full_state_dict,
)
from spmd.tensor import CommDebugMode, DTensor

IN, D, OUT, BATCH = 6, 10, 5, 4


class Block(nn.Module):
    """Rows that 2 and 4 ranks do not divide (31, 10 and 5), so shards are uneven."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, 3 * D + 1)
        self.fc2 = nn.Linear(3 * D + 1, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Net(nn.Module):
    def __init__(self, blocks: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, D)
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.head = nn.Linear(D, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def shard(model: Net, mesh: Any, **options: Any) -> Net:
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)
    return model


def _batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, IN, generator=g), torch.randn(n, OUT, generator=g)


def train_against_reference(
    mesh_shape: tuple[int, ...], steps: int = 5, accumulate: int = 1, reshard_after_forward: bool = True,
    param_dtype: torch.dtype | None = None, sync: str = "gradient",
) -> dict[str, Any]:
    """Train a sharded copy and a single-process reference (on the concatenated batch) side by side with AdamW.

    ``sync``: what accumulation turns off on all but the last micro-batch: "gradient" (every reduction) or
    "all_reduce" (HSDP's all-reduce only: the reduce-scattered gradients accumulate)."""
    world, rank = spmd.get_world_size(), spmd.get_rank()
    mesh = spmd.init_device_mesh("cpu", mesh_shape)
    torch.manual_seed(0)
    ref = Net()
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else None
    model = shard(copy.deepcopy(ref), mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    low = copy.deepcopy(ref).to(param_dtype) if param_dtype else ref
    losses, ref_losses, local_rows = [], [], {}
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and isinstance(p, nn.Parameter), name
        local_rows[name] = (p.to_local().shape[0], p.shape[0])
    for step in range(steps):
        x, y = _batch(step, world * accumulate * BATCH)
        total = torch.zeros(1)
        for micro in range(accumulate):
            if sync == "gradient":
                model.set_requires_gradient_sync(micro == accumulate - 1)  # type: ignore[operator]
            else:
                model.set_requires_all_reduce(micro == accumulate - 1)  # type: ignore[operator]
            start = (micro * world + rank) * BATCH
            xm, ym = x[start : start + BATCH], y[start : start + BATCH]
            loss = F.mse_loss(model(xm).float(), ym) / accumulate
            loss.backward()
            total += loss.detach()
        spmd.all_reduce(total, op=spmd.ReduceOp.SUM)
        losses.append(total.item() / world)
        opt.step()
        opt.zero_grad()
        # The reference: the same step on the whole batch, in the same precision.
        if param_dtype:
            with torch.no_grad():
                for lo, hi in zip(low.parameters(), ref.parameters()):
                    lo.copy_(hi)
            ref_loss = F.mse_loss(low(x.to(param_dtype)).float(), y)
            ref_loss.backward()
            for lo, hi in zip(low.parameters(), ref.parameters()):
                hi.grad = lo.grad.float()
                lo.grad = None
        else:
            ref_loss = F.mse_loss(ref(x), y)
            ref_loss.backward()
        ref_losses.append(ref_loss.item())
        ref_opt.step()
        ref_opt.zero_grad()
    full = get_full_state_dict(model, rank0_only=False)
    expected = ref.state_dict()
    diffs = {k: (full[k] - expected[k]).abs().max().item() for k in expected}
    grads_none = all(p.grad is None for p in model.parameters())
    return {"losses": losses, "ref_losses": ref_losses, "max_param_diff": max(diffs.values()), "diffs": diffs,
            "keys": sorted(full) == sorted(expected), "local_rows": local_rows, "grads_none": grads_none}


def count_collectives(reshard_after_forward: bool) -> dict[str, Any]:
    """All-gathers and reduce-scatters of one forward and one backward, through CommDebugMode."""
    mesh = spmd.init_device_mesh("cpu", (spmd.get_world_size(),))
    torch.manual_seed(0)
    model = shard(Net(), mesh, reshard_after_forward=reshard_after_forward)
    x, y = _batch(0, BATCH)
    counts = []
    for _ in range(2):  # the second iteration prefetches
        with CommDebugMode() as fwd:
            loss = F.mse_loss(model(x), y)
        with CommDebugMode() as bwd:
            loss.backward()
        counts.append((fwd.get_comm_counts(), bwd.get_comm_counts()))
    with torch.no_grad(), CommDebugMode() as evaluation:
        model(x)
    states = [block._spmd_fsdp_unit.state for block in model.blocks] + [model._spmd_fsdp_unit.state]
    return {"counts": counts, "eval": evaluation.get_comm_counts(), "states": states}


def state_dict_round_trips() -> dict[str, Any]:
    """Sharded and full state dicts: save from one model, load into a differently initialised one, both ways."""
    mesh = spmd.init_device_mesh("cpu", (spmd.get_world_size(),))
    torch.manual_seed(0)
    a = shard(Net(), mesh)
    torch.manual_seed(1)
    b = shard(Net(), mesh)
    torch.manual_seed(2)
    c = shard(Net(), mesh)
    sharded = a.state_dict()
    kinds = sorted({type(v).__name__ for v in sharded.values()})
    b.load_state_dict(sharded)
    full = get_full_state_dict(a, rank0_only=False)
    rank0 = get_full_state_dict(a)  # {} except on rank 0
    c.load_state_dict(full)
    torch.manual_seed(3)
    d = shard(Net(), mesh)
    load_full_state_dict(d, rank0, broadcast_from_rank0=True)
    x, _ = _batch(0, BATCH)
    out = a(x)
    plain = Net()
    plain.load_state_dict(full)
    return {
        "kinds": kinds,
        "b": torch.equal(b(x), out),
        "c": torch.equal(c(x), out),
        "d": torch.equal(d(x), out),
        "plain": torch.allclose(plain(x), out, atol=1e-6),
        "rank0_keys": len(rank0),
        "shards_are_views": all(p.to_local().untyped_storage().data_ptr() == b.blocks[0]._spmd_fsdp_unit.flat_shard.untyped_storage().data_ptr()
                                for p in b.blocks[0].parameters()),
    }


def unshard_and_strategy() -> dict[str, Any]:
    """unshard()/reshard(), explicit prefetch lists, and the "fsdp" strategy by name."""
    mesh = spmd.init_device_mesh("cpu", (spmd.get_world_size(),))
    torch.manual_seed(0)
    ref = Net()
    model = spmd.parallel.get_strategy("fsdp").apply(copy.deepcopy(ref), mesh=mesh)
    units = [m for m in model.modules() if hasattr(m, "unshard")]
    blocks = list(model.blocks)
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 2])
        block.set_modules_to_backward_prefetch(blocks[i - 1 : i] if i else [])
    handle = model.blocks[0].unshard(async_op=True)
    handle.wait()
    state = model.blocks[0]._spmd_fsdp_unit.state
    model.blocks[0].reshard()
    x, y = _batch(0, BATCH)
    F.mse_loss(model(x), y).backward()
    ref_grads = {}
    F.mse_loss(ref(x), y).backward()
    for name, p in ref.named_parameters():
        ref_grads[name] = p.grad
    spmd_grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    # Each rank used its own batch of the same data here, so the average is the reference gradient.
    grads = all(torch.allclose(spmd_grads[k], ref_grads[k], atol=1e-6) for k in ref_grads)
    inf_norm = clip_grad_norm_(model.parameters(), 1e9, norm_type=float("inf"))  # (max_norm too large to clip)
    ref_inf_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9, norm_type=float("inf"))
    norm = clip_grad_norm_(model.parameters(), 0.05)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    clipped = all(torch.allclose(p.grad.full_tensor(), q.grad, atol=1e-7) for p, q in zip(model.parameters(), ref.parameters()))
    return {"units": len(units), "state": state, "after": model.blocks[0]._spmd_fsdp_unit.state, "grads": grads,
            "norm": (norm.item(), ref_norm.item()), "inf_norm": (inf_norm.item(), ref_inf_norm.item()), "clipped": clipped}
