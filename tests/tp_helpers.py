"""Rank functions for test_tp.py: tensor-parallel modules against the same model in one process."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import spmd
from spmd import Replicate, Shard
from spmd.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from spmd.tensor import CommDebugMode, DTensor


class MLP(nn.Module):
    def __init__(self, dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Any) -> Any:
        b, s, d = x.shape
        q, k, v = (t(x).view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, s, d))


class Block(nn.Module):
    """A pre-norm transformer block; the module code knows nothing of tensor parallelism."""

    def __init__(self, dim: int = 8, heads: int = 4) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, 4 * dim)

    def forward(self, x: Any) -> Any:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def _grads_match(tp_model: nn.Module, ref: nn.Module, atol: float = 1e-5) -> dict[str, float]:
    """The largest gradient difference per parameter name (full tensors)."""
    ref_params = dict(ref.named_parameters())
    worst = {}
    for name, p in tp_model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        worst[name] = float((grad - ref_params[name].grad).abs().max())
    return worst


def mlp_colwise_rowwise() -> dict[str, Any]:
    mesh = spmd.init_device_mesh("cpu", (spmd.get_world_size(),), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    ref = MLP()
    model = copy.deepcopy(ref)
    parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    out = model(x)
    out.pow(2).sum().backward()
    ref_out = ref(x)
    ref_out.pow(2).sum().backward()
    return {
        "plain_output": type(out) is torch.Tensor,
        "output": float((out - ref_out).abs().max()),
        "grads": _grads_match(model, ref),
        "placements": {n: [str(q) for q in p.placements] for n, p in model.named_parameters()},
    }


def _sp_plan() -> dict[str, Any]:
    return {
        "norm1": SequenceParallel(),
        "attn": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
        "attn.q": ColwiseParallel(use_local_output=False),
        "attn.k": ColwiseParallel(use_local_output=False),
        "attn.v": ColwiseParallel(use_local_output=False),
        "attn.proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "norm2": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
        "mlp.fc1": ColwiseParallel(use_local_output=False),
        "mlp.fc2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }


def sequence_parallel_block() -> dict[str, Any]:
    """Heads split across ranks, sequence-parallel norms: outputs and every gradient against one process."""
    mesh = spmd.init_device_mesh("cpu", (spmd.get_world_size(),), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    ref = Block()
    model = copy.deepcopy(ref)
    parallelize_module(model, mesh, _sp_plan())
    x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(1))
    xd = spmd.distribute_tensor(x, mesh, [Shard(1)])  # the sequence split over the ranks
    with CommDebugMode() as forward:
        out = model(xd)
    loss = out.full_tensor().pow(2).sum()
    with CommDebugMode() as backward:
        loss.backward()
    ref_out = ref(x)
    ref_out.pow(2).sum().backward()
    grads = _grads_match(model, ref)
    partial_grads = sorted(n for n, p in model.named_parameters() if any(pl.is_partial() for pl in p.grad.placements))
    with CommDebugMode() as step:  # a partial gradient is reduced into its replicated parameter, which stays replicated
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    with CommDebugMode() as second_forward:
        model(xd)
    return {
        "out_placements": [str(p) for p in out.placements],
        "output": float((out.full_tensor() - ref_out).abs().max()),
        "grads": grads,
        "forward": forward.get_comm_counts(),
        "backward": backward.get_comm_counts(),
        "partial_grads": partial_grads,
        "step": step.get_comm_counts(),
        "second_forward": second_forward.get_comm_counts(),
        "placements_after_step": {n: [str(pl) for pl in p.placements] for n, p in model.named_parameters()},
    }


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 10, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mlp = MLP(dim, 16)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> Any:
        return self.head(self.mlp(self.embed(ids)))


def embedding_and_loss_parallel() -> dict[str, Any]:
    """Vocabulary-parallel embedding, colwise head with class-sharded logits, cross-entropy without gathering them."""
    mesh = spmd.init_device_mesh("cpu", (spmd.get_world_size(),), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    ref = TinyLM()
    model = copy.deepcopy(ref)
    parallelize_module(model, mesh, {
        "embed": RowwiseParallel(),
        "mlp.fc1": ColwiseParallel(),
        "mlp.fc2": RowwiseParallel(),
        "head": ColwiseParallel(use_local_output=False),
    })
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 10, (3, 5), generator=g)
    target = torch.randint(0, 10, (15,), generator=g)
    target[2] = -100  # ignored
    with loss_parallel(), CommDebugMode() as comm:
        logits = model(ids)
        loss = F.cross_entropy(logits.flatten(0, 1), spmd.distribute_tensor(target, mesh, [Replicate()]))
        loss.backward()
    ref_loss = F.cross_entropy(ref(ids).flatten(0, 1), target)
    ref_loss.backward()
    return {
        "logits": [str(p) for p in logits.placements],
        "loss": abs(float(loss.full_tensor()) - float(ref_loss)),
        "grads": _grads_match(model, ref),
        "gathered_logits": comm.get_comm_counts().get("all_gather", 0),
        "embed": [str(p) for p in model.embed.weight.placements],
    }


class Doubling(ParallelStyle):
    """A third-party style: replicate the parameters and double the output."""

    def apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        module.register_forward_hook(lambda mod, args, out: out * 2)
        return module


def wildcard_plan_and_custom_style() -> dict[str, Any]:
    mesh = spmd.init_device_mesh("cpu", (spmd.get_world_size(),), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = nn.ModuleDict({"layers": nn.ModuleList([MLP(), MLP()])})
    parallelize_module(model, mesh, {"layers.*.fc1": "colwise", "layers.*.fc2": RowwiseParallel()})
    doubled = parallelize_module(nn.Identity(), mesh, Doubling())
    try:
        parallelize_module(model, mesh, {"layers.*.nope": ColwiseParallel()})
        missing = "no error"
    except ValueError as error:
        missing = str(error)
    return {
        "placements": {n: [str(q) for q in p.placements] for n, p in model.named_parameters()},
        "doubled": doubled(torch.ones(2)).tolist(),
        "missing": missing,
    }


class Stack(nn.Module):
    def __init__(self, depth: int = 2, dim: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))

    def forward(self, x: Any) -> Any:
        for block in self.blocks:
            x = block(x)
        return x


def tensor_parallel_inside_fsdp(steps: int = 3) -> dict[str, Any]:
    """(dp 2, tp 2): heads and MLPs split over tp, then fully_shard over dp; optimizer steps against one process."""
    from spmd.parallel import (
        clip_grad_norm_,
        fully_shard,
        get_full_state_dict,
        load_full_state_dict,
    )

    mesh = spmd.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    torch.manual_seed(0)
    ref = Stack()
    model = copy.deepcopy(ref)
    parallelize_module(model, mesh["tp"], {f"blocks.*.{k}": v for k, v in _sp_plan().items()})
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    # SGD, not Adam: attention's key bias has a zero gradient in exact arithmetic, and Adam would
    # blow its rounding noise (1e-9) up to full-size steps that differ between any two summation orders
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    generator = torch.Generator().manual_seed(1)
    loss_diffs, norm_diffs = [], []
    for _ in range(steps):
        x = torch.randn(4, 6, 8, generator=generator)  # every rank draws the whole batch: replica dp takes half
        mine = x[2 * dp : 2 * dp + 2]
        local = mine.chunk(2, dim=1)[tp]  # the sequence split over tp
        out = model(DTensor.from_local(local, mesh["tp"], [Shard(1)]))
        loss = out.full_tensor().pow(2).mean()
        loss.backward()
        norm = clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            ref_half = ref(mine).pow(2).mean()
        ref(x).pow(2).mean().backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        loss_diffs.append(float((loss.detach() - ref_half).abs()))
        norm_diffs.append(float((norm - ref_norm).abs()))
    full = get_full_state_dict(model, rank0_only=False)
    ref_state = ref.state_dict()
    q = model.blocks[0].attn.q.weight
    torch.manual_seed(5)
    other = Stack().state_dict()  # full tensors in: each rank keeps its (tp, dp) piece
    load_full_state_dict(model, other)
    reloaded = get_full_state_dict(model, rank0_only=False)
    return {
        "reloaded": all(torch.equal(reloaded[k], other[k]) for k in other),
        "loss": max(loss_diffs),
        "norm": max(norm_diffs),
        "params": max(float((full[k] - ref_state[k]).abs().max()) for k in ref_state),
        "keys": sorted(full) == sorted(ref_state),
        "q_layout": (q.device_mesh.mesh_dim_names, [str(p) for p in q.placements], tuple(q.to_local().shape)),
        "norm_layout": [str(p) for p in model.blocks[0].norm1.weight.placements],
    }


def loss_parallel_with_a_rank_holding_no_class() -> dict[str, Any]:
    """6 classes on 4 ranks (2, 2, 2 and 0): the rank without classes joins every reduction; loss and gradient equal torch's."""
    mesh = spmd.init_device_mesh("cpu", (spmd.get_world_size(),), mesh_dim_names=("tp",))
    g = torch.Generator().manual_seed(3)
    full = torch.randn(5, 6, generator=g)
    target = torch.randint(0, 6, (5,), generator=g)
    logits = spmd.distribute_tensor(full, mesh, [Shard(1)]).requires_grad_()
    with loss_parallel():
        loss = F.cross_entropy(logits, spmd.distribute_tensor(target, mesh, [Replicate()]))
        loss.backward()
    ref = full.clone().requires_grad_()
    F.cross_entropy(ref, target).backward()
    return {
        "local_classes": logits.to_local().shape[1],
        "loss": abs(float(loss.full_tensor()) - float(F.cross_entropy(full, target))),
        "grad": float((logits.grad.full_tensor() - ref.grad).abs().max()),
    }
