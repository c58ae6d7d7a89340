"""Rank functions for test_fsdp_init.py: spmd's fully_shard set-up paths against torch's fully_shard in the same world.

Each function builds the same model three ways — spmd ``fully_shard``, torch
``fully_shard`` (over spmd's ProcessGroup bridge) and a one-process reference
trained on the whole batch — and returns their loss curves.
"""

from __future__ import annotations

import copy
import math
import pickle
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh as torch_mesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import distribute_tensor as torch_distribute
from torch.nn import functional as F

import spmd
from spmd.parallel import FSDPModule, MixedPrecisionPolicy, fully_shard, get_full_state_dict

V, D, T, BATCH = 19, 8, 5, 2  # vocabulary, width, tokens, sequences per rank (rows 2 ranks do not divide)


class Block(nn.Module):
    """A transformer block: LayerNorm, single-head attention, LayerNorm, MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D, bias=False)  # a key bias gets zero gradient (softmax ignores it): Adam amplifies its rounding
        self.proj = nn.Linear(D, D)
        self.ln2 = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, 4 * D + 1)
        self.fc2 = nn.Linear(4 * D + 1, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        attn = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D), dim=-1)
        x = x + self.proj(attn @ v)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Model(nn.Module):
    def __init__(self, blocks: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def reset_parameters(self) -> None:
        """Every submodule's own initialisation (torch's standard init, in module order)."""
        for m in self.modules():
            if m is not self and hasattr(m, "reset_parameters"):
                m.reset_parameters()


def _shard(model: Model, fs: Callable[..., Any], mesh: Any, group: bool = False, **options: Any) -> Model:
    for block in model.blocks:
        fs(block, mesh=mesh, **options)
    if group:
        fs([model.norm, model.head], mesh=mesh, **options)
    fs(model, mesh=mesh, **options)
    return model


def _meshes() -> tuple[Any, Any]:
    world = spmd.get_world_size()
    return spmd.init_device_mesh("cpu", (world,)), torch_mesh("cpu", (world,))


def _reference() -> tuple[Model, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    ref = Model()
    return ref, {k: v.clone() for k, v in ref.state_dict().items()}


def _torch_copy_in(model: nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Torch's sharded parameters set to ``full``'s values (each rank its piece, no communication)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch_distribute(full[name], p.device_mesh, p.placements, src_data_rank=None))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    n = spmd.get_world_size() * BATCH
    return torch.randint(0, V, (n, T), generator=g), torch.randint(0, V, (n, T), generator=g)


def _loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens).float().reshape(-1, V), targets.reshape(-1))


def _train(model: nn.Module, steps: int, sharded: bool = True, opt: Any = None) -> list[float]:
    """Loss per step with AdamW; sharded: each rank its rows of the batch, the loss averaged over ranks."""
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    rank, world = spmd.get_rank(), spmd.get_world_size()
    losses = []
    for step in range(steps):
        x, y = _batch(step)
        if sharded:
            x, y = x[rank * BATCH : (rank + 1) * BATCH], y[rank * BATCH : (rank + 1) * BATCH]
        loss = _loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.detach().reshape(1)
        if sharded:
            spmd.all_reduce(value, op=spmd.ReduceOp.SUM)
            value /= world
        losses.append(value.item())
    return losses


def _diffs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return {k: (a[k].float() - b[k].float()).abs().max().item() for k in a}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(_diffs(a, b).values())


def _torch_full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor().detach() for k, v in model.state_dict().items()}


def meta_init(steps: int = 5) -> dict[str, Any]:
    """meta -> fully_shard -> to_empty -> reset_parameters, against torch's fully_shard and the reference."""
    mesh, tmesh = _meshes()
    ref, full = _reference()
    with torch.device("meta"):
        ours = Model()
    _shard(ours, fully_shard, mesh)
    ours.to_empty(device="cpu")
    torch.manual_seed(0)
    ours.reset_parameters()  # spmd computes each random init on the full tensor: the one-process values
    init_diff = _max_diff(get_full_state_dict(ours, rank0_only=False), full)
    with torch.device("meta"):
        theirs = Model()
    _shard(theirs, torch_fully_shard, tmesh)
    theirs.to_empty(device="cpu")
    _torch_copy_in(theirs, full)  # torch's CPU DTensor draws each shard from each rank's generator: set the same init
    return {
        "init_diff": init_diff,
        "ours": _train(ours, steps),
        "torch": _train(theirs, steps),
        "ref": _train(ref, steps, sharded=False),
        "final_diff": _max_diff(get_full_state_dict(ours, rank0_only=False), {k: v.detach() for k, v in ref.state_dict().items()}),
        "vs_torch": _max_diff(get_full_state_dict(ours, rank0_only=False), _torch_full(theirs)),
    }


def _changes_on_step(model: nn.Module) -> float:
    """The smallest change any parameter sees in one AdamW step (0: some parameter the optimizer does not step)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    before = get_full_state_dict(model, rank0_only=False)
    x, y = _batch(99)
    rank = spmd.get_rank()
    _loss(model, x[rank * BATCH : (rank + 1) * BATCH], y[rank * BATCH : (rank + 1) * BATCH]).backward()
    opt.step()
    opt.zero_grad()
    after = get_full_state_dict(model, rank0_only=False)
    return min((after[k] - before[k]).abs().max().item() for k in before)


def cpu_to_empty_and_assign(steps: int = 5) -> dict[str, Any]:
    """CPU-built -> fully_shard -> to_empty -> reset_parameters; and load_state_dict(full, assign=True) after
    fully_shard (CPU- and meta-built), each against torch's fully_shard and the reference."""
    mesh, tmesh = _meshes()
    ref, full = _reference()
    out: dict[str, Any] = {"ref": _train(ref, steps, sharded=False)}
    ref_final = {k: v.detach() for k, v in ref.state_dict().items()}

    torch.manual_seed(5)
    ours = _shard(Model(), fully_shard, mesh)
    ours.to_empty(device="cpu")
    torch.manual_seed(0)
    ours.reset_parameters()
    out["to_empty_init_diff"] = _max_diff(get_full_state_dict(ours, rank0_only=False), full)
    out["to_empty"] = _train(ours, steps)
    out["to_empty_final_diff"] = _max_diff(get_full_state_dict(ours, rank0_only=False), ref_final)
    torch.manual_seed(5)
    theirs = _shard(Model(), torch_fully_shard, tmesh)
    theirs.to_empty(device="cpu")
    _torch_copy_in(theirs, full)
    out["torch_to_empty"] = _train(theirs, steps)

    for built in ("cpu", "meta"):
        with torch.device(built):
            torch.manual_seed(7)
            ours = Model()
        _shard(ours, fully_shard, mesh)
        ours.load_state_dict(full, assign=True)
        out[f"assign_{built}_init_diff"] = _max_diff(get_full_state_dict(ours, rank0_only=False), full)
        out[f"assign_{built}"] = _train(ours, steps)
        out[f"assign_{built}_final_diff"] = _max_diff(get_full_state_dict(ours, rank0_only=False), ref_final)
    with torch.device("meta"):
        theirs = Model()
    _shard(theirs, torch_fully_shard, tmesh)
    sharded = {name: torch_distribute(full[name], p.device_mesh, p.placements, src_data_rank=None)
               for name, p in theirs.named_parameters()}
    theirs.load_state_dict(sharded, assign=True)
    out["torch_assign"] = _train(theirs, steps)

    # assign=True with another sharded model's DTensors: ours gets its own flat shard; the source is untouched
    torch.manual_seed(0)
    source = _shard(Model(), fully_shard, mesh)
    source_before = get_full_state_dict(source, rank0_only=False)
    torch.manual_seed(8)
    ours = _shard(Model(), fully_shard, mesh)
    ours.load_state_dict(source.state_dict(), assign=True)
    out["assign_sharded"] = _train(ours, steps)
    out["source_untouched"] = _max_diff(get_full_state_dict(source, rank0_only=False), source_before) == 0.0

    # the silent-failure guard: after each path, one optimizer step changes every parameter the forward reads
    with torch.device("meta"):
        guard = Model()
    _shard(guard, fully_shard, mesh)
    guard.to_empty(device="cpu")
    guard.reset_parameters()
    out["step_changes_meta"] = _changes_on_step(guard)
    guard = _shard(Model(), fully_shard, mesh)
    guard.load_state_dict(full, assign=True)
    out["step_changes_assign"] = _changes_on_step(guard)
    return out


def module_class_and_group(steps: int = 5) -> dict[str, Any]:
    """FSDPModule isinstance and class names; fully_shard([norm, head]) trained against torch's grouping."""
    mesh, tmesh = _meshes()
    ref, full = _reference()
    torch.manual_seed(0)
    ours = Model()
    before = isinstance(ours, FSDPModule) or isinstance(ours.blocks[0], FSDPModule)
    _shard(ours, fully_shard, mesh, group=True)
    torch.manual_seed(0)
    theirs = _shard(Model(), torch_fully_shard, tmesh, group=True)
    out: dict[str, Any] = {
        "before": before,
        "after": [isinstance(m, FSDPModule) for m in (ours, ours.blocks[0], ours.norm, ours.head)],
        "plain_parts": [isinstance(m, FSDPModule) for m in (ours.emb, ours.blocks[0].fc1)],
        "names": [type(m).__name__ for m in (ours, ours.blocks[0], ours.norm, ours.head)],
        "torch_names": [type(m).__name__ for m in (theirs, theirs.blocks[0], theirs.norm, theirs.head)],
        "torch_isinstance": isinstance(theirs.norm, TorchFSDPModule),
        "still_model": isinstance(ours, Model) and isinstance(ours.head, nn.Linear),
        "one_unit": ours.norm._spmd_fsdp_unit is ours.head._spmd_fsdp_unit,
        "units": len({id(m._spmd_fsdp_unit) for m in ours.modules() if isinstance(m, FSDPModule)}),
    }
    errors = {}
    for call in (lambda: ours.set_post_optim_event(None), lambda: ours.set_custom_all_gather(None),
                 lambda: copy.deepcopy(ours), lambda: pickle.dumps(ours)):
        try:
            call()
            errors[len(errors)] = "none"
        except Exception as e:  # noqa: BLE001 - the kind is the result
            errors[len(errors)] = type(e).__name__
    out["errors"] = list(errors.values())
    out["ours"] = _train(ours, steps)
    out["torch"] = _train(theirs, steps)
    out["ref"] = _train(ref, steps, sharded=False)
    return out


class Residual(nn.Module):
    """A block whose output dtype follows its input's (the residual adds the input as it came)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, 2 * D + 1)
        self.fc2 = nn.Linear(2 * D + 1, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x.to(self.fc1.weight.dtype))))


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Residual() for _ in range(3))
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x.to(self.head.weight.dtype))


def _stack_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    n = spmd.get_world_size() * BATCH
    return torch.randn(n, D, generator=g), torch.randn(n, 3, generator=g)


def _train_stack(model: nn.Module, opt: Any, steps: int) -> tuple[list[float], str]:
    rank, world = spmd.get_rank(), spmd.get_world_size()
    losses, dtype = [], ""
    for step in range(steps):
        x, y = _stack_batch(step)
        out = model(x[rank * BATCH : (rank + 1) * BATCH])
        dtype = str(out.dtype)
        loss = F.mse_loss(out.float(), y[rank * BATCH : (rank + 1) * BATCH])
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.detach().reshape(1)
        spmd.all_reduce(value, op=spmd.ReduceOp.SUM)
        losses.append(value.item() / world)
    return losses, dtype


def mixed_precision(block_cast: bool, steps: int = 4) -> dict[str, Any]:
    """bf16 compute, fp32 reduction; the root casts nothing and outputs fp32, the blocks cast their inputs or not."""
    mesh, tmesh = _meshes()
    results = {}
    for name, fs, policy, m in (("ours", fully_shard, MixedPrecisionPolicy, mesh), ("torch", torch_fully_shard, TorchMP, tmesh)):
        torch.manual_seed(0)
        model = Stack()
        for block in model.blocks:
            fs(block, mesh=m, mp_policy=policy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                cast_forward_inputs=block_cast))
        fs(model, mesh=m, mp_policy=policy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                            output_dtype=torch.float32, cast_forward_inputs=False))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        results[name], results[f"{name}_dtype"] = _train_stack(model, opt, steps)
    return results


def divide_factor(factor: float, steps: int = 4) -> dict[str, Any]:
    """set_gradient_divide_factor on every unit, SGD (which sees the gradients' scale): spmd against torch
    and against the reference whose full-batch mean gradient is scaled by world / factor."""
    mesh, tmesh = _meshes()
    world = spmd.get_world_size()
    out: dict[str, Any] = {}
    for name, fs, m in (("ours", fully_shard, mesh), ("torch", torch_fully_shard, tmesh)):
        torch.manual_seed(0)
        model = _shard(Model(), fs, m)
        for sub in model.modules():
            if isinstance(sub, (FSDPModule, TorchFSDPModule)):
                sub.set_gradient_divide_factor(factor)
            if isinstance(sub, TorchFSDPModule):  # torch divides with NCCL's PREMUL_SUM unless told to SUM and divide
                sub.set_force_sum_reduction_for_comms(True)
        out[name] = _train(model, steps, opt=torch.optim.SGD(model.parameters(), lr=0.5))
    torch.manual_seed(0)
    ref = Model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    losses = []
    for step in range(steps):
        x, y = _batch(step)
        loss = _loss(ref, x, y)
        loss.backward()
        for p in ref.parameters():
            p.grad *= world / factor  # the sum of the ranks' mean gradients, divided by factor
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    out["ref"] = losses
    return out


class Tied(nn.Module):
    """The head's weight is the embedding's (one parameter under two names in the state dict)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(tokens)))


def tied_and_double(steps: int = 3) -> dict[str, Any]:
    """Tied weights through meta -> fully_shard -> to_empty -> load_state_dict (both names), and .double()
    after fully_shard, each against the one-process reference."""
    mesh, _ = _meshes()
    torch.manual_seed(0)
    ref = Tied()
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    with torch.device("meta"):
        tied = Tied()
    fully_shard(tied, mesh=mesh)
    tied.to_empty(device="cpu")
    tied.load_state_dict(state)
    out: dict[str, Any] = {"keys": sorted(state), "still_tied": tied.emb.weight is tied.head.weight}
    out["tied"], out["tied_ref"] = _train(tied, steps), _train(ref, steps, sharded=False)
    ref64, full = _reference()
    ref64.double()
    torch.manual_seed(0)
    ours = _shard(Model(), fully_shard, mesh).double()
    out["dtype"] = str(ours.head.weight.dtype)
    out["double"], out["double_ref"] = _train(ours, steps), _train(ref64, steps, sharded=False)
    return out


def kept_unsharded_after_backward(steps: int = 4) -> dict[str, Any]:
    """set_reshard_after_backward(False) on every unit through the optimizer steps: the next forward must gather
    the stepped shards, not reuse the kept (stale) unsharded parameters."""
    mesh, _ = _meshes()
    ref, _ = _reference()
    torch.manual_seed(0)
    ours = _shard(Model(), fully_shard, mesh)
    ours.set_reshard_after_backward(False)
    losses = _train(ours, steps)
    states = [m._spmd_fsdp_unit.state for m in ours.modules() if isinstance(m, FSDPModule)]
    return {"ours": losses, "ref": _train(ref, steps, sharded=False), "states": states}
