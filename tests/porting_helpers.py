"""Rank functions for test_porting.py: spmd's torch-path features against torch's own in the same 2-rank world."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn


def _names(placements: Any) -> list[str]:
    return [type(p).__name__ for p in placements]


def implicit_replication_against_torch() -> dict:
    import torch.distributed.tensor as tt
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh
    from torch.distributed.tensor.experimental import implicit_replication as torch_implicit

    import spmd
    from spmd.tensor.dispatch import MixedTensorError
    from spmd.tensor.experimental import implicit_replication

    torch.manual_seed(0)
    x, plain = torch.randn(8, 4), torch.randn(8, 4)
    mesh, tmesh = spmd.init_device_mesh("cpu", (2,)), torch_mesh("cpu", (2,))
    dt = spmd.distribute_tensor(x, mesh, [spmd.Shard(0)])
    tdt = tt.distribute_tensor(x, tmesh, [tt.Shard(0)])
    raised = []
    try:
        dt + plain
    except MixedTensorError:
        raised.append("MixedTensorError")
    try:
        tdt + plain
    except Exception:  # noqa: BLE001 - torch's message and type vary by version
        raised.append("torch raised")
    with implicit_replication():
        out = dt * plain + plain[0]
    with torch_implicit():
        tout = tdt * plain + plain[0]
    expected = x * plain + plain[0]
    return {
        "raised_outside": raised,
        "placements": _names(out.placements), "torch_placements": _names(tout.placements),
        "diff": float((out.full_tensor() - expected).abs().max()),
        "torch_diff": float((tout.full_tensor() - expected).abs().max()),
    }


def local_map_against_torch() -> dict:
    import torch.distributed.tensor as tt
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh
    from torch.distributed.tensor.experimental import local_map as torch_local_map

    import spmd
    from spmd.tensor import Partial, Shard
    from spmd.tensor.experimental import local_map

    torch.manual_seed(0)
    w, x = torch.randn(6, 8), torch.randn(8, 4)
    mesh, tmesh = spmd.init_device_mesh("cpu", (2,)), torch_mesh("cpu", (2,))

    def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a @ b  # each rank's block product: a partial sum of the full product

    ours = local_map(mm, [Partial()], ([Shard(1)], [Shard(0)]), device_mesh=mesh)
    theirs = torch_local_map(mm, [tt.Partial()], ([tt.Shard(1)], [tt.Shard(0)]), device_mesh=tmesh)
    wd = spmd.distribute_tensor(w.clone().requires_grad_(), mesh, [Shard(1)])
    xd = spmd.distribute_tensor(x, mesh, [Shard(0)])
    twd = tt.distribute_tensor(w.clone().requires_grad_(), tmesh, [tt.Shard(1)])
    txd = tt.distribute_tensor(x, tmesh, [tt.Shard(0)])
    out, tout = ours(wd, xd), theirs(twd, txd)
    out.full_tensor().sum().backward()
    tout.full_tensor().sum().backward()
    mismatch = []
    for fn, a, b in ((ours, xd, xd), (theirs, txd, txd)):
        try:
            fn(a, b)  # x is Shard(0), the first input must be Shard(1)
        except ValueError:
            mismatch.append("ValueError")
    redistributing = local_map(mm, [Partial()], ([Shard(1)], [Shard(0)]), redistribute_inputs=True)
    replicated_w = spmd.distribute_tensor(w, mesh, [spmd.Replicate()])
    return {
        "output": float((out.full_tensor() - w @ x).abs().max()),
        "torch_output": float((tout.full_tensor() - w @ x).abs().max()),
        "grads": float((wd.grad.full_tensor() - twd.grad.full_tensor()).abs().max()),
        "placements": _names(out.placements), "torch_placements": _names(tout.placements),
        "mismatch": mismatch,
        "redistributed": float((redistributing(replicated_w, xd).full_tensor() - w @ x).abs().max()),
        "plain": isinstance(ours(w, x), torch.Tensor) and not isinstance(ours(w, x), spmd.DTensor),
    }


class _App:
    """A Stateful object that records the calls DCP makes."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.step = 0
        self.calls: list[str] = []

    def state_dict(self) -> dict[str, Any]:
        self.calls.append("state_dict")
        return {"model": self.model.state_dict(), "step": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.calls.append("load_state_dict")
        self.model.load_state_dict(state_dict["model"])
        self.step = state_dict["step"]


def stateful_save_load(path: str) -> dict:
    import spmd
    import spmd.checkpoint as dcp
    from spmd.tensor.parallel import ColwiseParallel, parallelize_module

    torch.manual_seed(0)
    mesh = spmd.init_device_mesh("cpu", (2,))
    model = parallelize_module(nn.Sequential(nn.Linear(4, 8)), mesh, {"0": ColwiseParallel()})
    other = nn.Linear(3, 3)
    app = _App(model)
    app.step = 7
    assert isinstance(app, dcp.Stateful) and isinstance(other, dcp.Stateful)
    before = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    other_before = copy.deepcopy(other.state_dict())
    dcp.save({"app": app, "other": other}, storage_writer=dcp.FileSystemWriter(path))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for p in other.parameters():
            p.zero_()
    app.step = 0
    dcp.load({"app": app, "other": other}, checkpoint_id=path)
    return {
        "calls": app.calls,
        "step": app.step,
        "restored": all(torch.equal(v.full_tensor(), before[k]) for k, v in model.state_dict().items()),
        "model_restored": all(torch.equal(v, other_before[k]) for k, v in other.state_dict().items()),
    }


def _tp_model(parallelize: Any, styles: Any, mesh: Any) -> nn.Module:
    torch.manual_seed(1)  # a different init from the reference: the load must overwrite it
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4), nn.Linear(4, 2))
    model[3].requires_grad_(False)  # frozen
    return parallelize(model, mesh, {"0": styles[0](), "2": styles[1]()})


def broadcast_from_rank0_against_torch() -> dict:
    import torch.distributed.checkpoint.state_dict as tsd
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel as TCol
    from torch.distributed.tensor.parallel import RowwiseParallel as TRow
    from torch.distributed.tensor.parallel import parallelize_module as tparallelize

    import spmd
    import spmd.checkpoint.state_dict as sd
    from spmd.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    rank = spmd.get_rank()
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4), nn.Linear(4, 2))
    reference[3].requires_grad_(False)
    ref_opt = torch.optim.Adam([p for p in reference.parameters() if p.requires_grad], lr=0.1)
    reference(torch.randn(3, 4)).sum().backward()
    ref_opt.step()
    full_model = reference.state_dict() if rank == 0 else {}
    full_optim = sd.get_optimizer_state_dict(reference, ref_opt) if rank == 0 else {}

    mesh, tmesh = spmd.init_device_mesh("cpu", (2,)), torch_mesh("cpu", (2,))
    ours = _tp_model(parallelize_module, (ColwiseParallel, RowwiseParallel), mesh)
    theirs = _tp_model(tparallelize, (TCol, TRow), tmesh)
    opt = torch.optim.Adam([p for p in ours.parameters() if p.requires_grad], lr=0.1)
    topt = torch.optim.Adam([p for p in theirs.parameters() if p.requires_grad], lr=0.1)
    options = sd.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    sd.set_state_dict(ours, opt, model_state_dict=copy.deepcopy(full_model), optim_state_dict=copy.deepcopy(full_optim), options=options)
    # torch's reference: its broadcast_from_rank0 asks the group for pg._device_types, which spmd's interop group
    # leaves empty (IndexError in torch's _broadcast_tensors), so torch's side gets rank 0's full state dicts on every
    # rank and distributes them with full_state_dict=True: the same shards torch's broadcast would leave
    every_rank = [full_model, full_optim]
    spmd.broadcast_object_list(every_rank, src=0)
    tsd.set_state_dict(theirs, topt, model_state_dict=every_rank[0], optim_state_dict=every_rank[1],
                       options=tsd.StateDictOptions(full_state_dict=True))

    full = sd.StateDictOptions(full_state_dict=True)
    got_model = sd.get_model_state_dict(ours, options=full)
    got_optim = sd.get_optimizer_state_dict(ours, opt, options=full)
    expect_optim = sd.get_optimizer_state_dict(reference, ref_opt)

    def diff(a: Any, b: Any) -> float:
        if isinstance(a, torch.Tensor):
            return float((a.float() - torch.as_tensor(b).float()).abs().max()) if a.numel() else 0.0
        if isinstance(a, dict):
            assert a.keys() == b.keys(), (sorted(a), sorted(b))
            return max([diff(a[k], b[k]) for k in a] or [0.0])
        return 0.0 if a == b else float("inf")

    local = {k: v._local_tensor for k, v in ours.state_dict().items() if hasattr(v, "_local_tensor")}
    tlocal = {k: v.to_local() for k, v in theirs.state_dict().items() if hasattr(v, "to_local")}
    opt_local = [v._local_tensor for st in opt.state.values() for v in st.values() if hasattr(v, "_local_tensor")]
    topt_local = [v.to_local() for st in topt.state.values() for v in st.values() if hasattr(v, "to_local")]
    rank0_only = sd.get_model_state_dict(ours, options=sd.StateDictOptions(full_state_dict=True, cpu_offload=True)) == {}
    frozen = sd.get_model_state_dict(ours, options=sd.StateDictOptions(ignore_frozen_params=True))
    return {
        "rank": rank,
        "model": diff(got_model, reference.state_dict()),
        "optim": diff(got_optim["state"], expect_optim["state"]),
        "vs_torch_model": diff(local, tlocal),
        "vs_torch_optim": max(float((a - b).abs().max()) for a, b in zip(opt_local, topt_local, strict=True)),
        "rank0_only": rank0_only,
        "frozen_left_out": "3.weight" not in frozen and "0.weight" in frozen,
    }


def pipelining_torch_names(cls_name: str, stages_per_rank: int, n_microbatches: int) -> dict:
    """One step through spmd.pipelining's torch-named classes, torch's way of calling them; grads and losses back."""
    import pipeline_helpers as ph
    import torch.nn.functional as F

    import spmd
    import spmd.pipelining as pp
    from spmd.pipeline import split_module

    rank, world = spmd.get_rank(), spmd.get_world_size()
    num_stages = world * stages_per_rank
    pieces = split_module(ph.make_model(num_stages), num_stages=num_stages)
    mine = list(range(rank, num_stages, world))
    stages = [pp.PipelineStage(pieces[s], s, num_stages, torch.device("cpu")) for s in mine]
    cls = getattr(pp, cls_name)
    schedule = cls(stages if stages_per_rank > 1 else stages[0], n_microbatches, loss_fn=F.mse_loss)
    x, y = ph.make_batch()
    losses: list[torch.Tensor] = []
    if 0 in mine and num_stages - 1 in mine:
        schedule.step(x, target=y, losses=losses)
    elif 0 in mine:
        schedule.step(x)
    else:
        schedule.step(target=y, losses=losses)
    grads = {s: [p.grad.clone() for p in pieces[s].parameters()] for s in mine}
    expected, expected_losses = ph.reference(num_stages, n_microbatches)
    return {
        "grads": max(float((g - e).abs().max()) for s in mine for g, e in zip(grads[s], expected[s], strict=True)),
        "losses": max((abs(loss.item() - e) for loss, e in zip(losses, expected_losses, strict=True)), default=0.0) if losses else 0.0,
        "had_losses": bool(losses),
    }


def torch_broadcast_from_rank0_over_spmd() -> bool:
    """torch's own set_model_state_dict(broadcast_from_rank0=True) on torch's fully_shard, over spmd's ProcessGroup
    (it read the group's _device_types, which the bridge left empty: IndexError)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import spmd

    torch.manual_seed(0)
    reference = nn.Linear(4, 6)
    full = {k: v.clone() for k, v in reference.state_dict().items()} if spmd.get_rank() == 0 else {}
    torch.manual_seed(10 + spmd.get_rank())  # every rank starts from other weights
    model = nn.Linear(4, 6)
    torch_fully_shard(model, mesh=torch_mesh("cpu", (spmd.get_world_size(),)))
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return all(torch.equal(p.full_tensor(), reference.state_dict()[k]) for k, p in model.state_dict().items())
