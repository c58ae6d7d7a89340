"""Rank functions for test_pipeline.py (pickled by reference, run on every rank)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import spmd
from spmd.debug.recorder import entry_of, recorder
from spmd.pipeline import PipelineStage, get_schedule, split_module

BATCH, WIDTH = 16, 6


def make_model(num_stages: int) -> nn.Sequential:
    """Two layers per stage (Linear, Tanh), the same on every rank."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(num_stages):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers)


def make_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Input and target of the whole batch."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)


def reference(num_stages: int, n_microbatches: int) -> tuple[list[list[torch.Tensor]], list[float]]:
    """One process, the whole model on the whole batch: per-stage gradients and per-microbatch losses."""
    model = make_model(num_stages)
    x, y = make_batch()
    F.mse_loss(model(x), y).backward()
    pieces = split_module(model, num_stages=num_stages)
    with torch.no_grad():
        losses = [F.mse_loss(model(xm), ym).item() for xm, ym in zip(x.tensor_split(n_microbatches), y.tensor_split(n_microbatches), strict=True)]
    return [[p.grad.clone() for p in piece.parameters()] for piece in pieces], losses


def run_step(name: str, stages_per_rank: int, n_microbatches: int, group: Any = None, input_args: bool = False) -> dict[str, Any]:
    """One pipeline step of ``name``; this rank's stages' gradients and (last rank) the losses.

    ``input_args``: every stage but the first is given an example microbatch input."""
    g = group if group is not None else spmd.new_group()
    world, rank = g.size, g.rank
    num_stages = world * stages_per_rank
    pieces = split_module(make_model(num_stages), num_stages=num_stages)
    mine = list(range(rank, num_stages, world))
    example = torch.zeros(BATCH // n_microbatches, WIDTH)
    stages = [PipelineStage(pieces[s], s, num_stages, "cpu", group=g, input_args=example if input_args and s else None) for s in mine]
    schedule = get_schedule(name)(stages if stages_per_rank > 1 else stages[0], n_microbatches, loss_fn=F.mse_loss)
    x, y = make_batch()
    losses: list[torch.Tensor] = []
    kwargs: dict[str, Any] = {}
    if 0 in mine:
        kwargs["x"] = x
    if num_stages - 1 in mine:
        kwargs.update(target=y, losses=losses)
    args = (kwargs.pop("x"),) if "x" in kwargs else ()
    out = schedule.step(*args, **kwargs)
    contexts = sorted({e.context for e in map(entry_of, recorder.entries) if e.context is not None})
    return {
        "grads": {s: [p.grad.tolist() for p in pieces[s].parameters()] for s in mine},
        "losses": [loss.item() for loss in losses],
        "out_shape": tuple(out.shape) if out is not None else None,
        "contexts": contexts[:3],
    }


def _use_test_schedules() -> None:
    """Register the test schedule plugin in this process (once)."""
    import pipeline_plugin

    pm = spmd.plugins.manager()
    if pm.get_plugin("test-pipeline") is None:
        pm.register(pipeline_plugin, name="test-pipeline")


def third_party() -> dict[str, Any]:
    """Register the test plugin here, run its schedule; the broken one fails before any transfer."""
    _use_test_schedules()
    result = run_step("test_reverse_gpipe", 1, 4)
    g = spmd.new_group()
    stage = PipelineStage(nn.Linear(2, 2), g.rank, g.size, "cpu", group=g)
    before = len(recorder.entries)
    try:
        get_schedule("test_drops_a_receive")(stage, 4, loss_fn=F.mse_loss)
        error = "no error"
    except spmd.pipeline.ScheduleError as e:
        error = str(e)
    result["broken"] = error
    # (the ranks' set-up agreement is one all-gather before validation; no point-to-point transfer may follow)
    result["p2p_after_broken"] = sum(1 for e in list(recorder.entries)[before:] if e.seq == -1)
    return result


def timeout_names_the_action() -> str:
    """Rank 1 waits for a stage rank 0 never runs; its timeout names stage, microbatch, action and peer."""
    g = spmd.new_group(timeout=timedelta(seconds=2))
    spmd.barrier(group=g)  # the group's backend exists on both ranks before rank 0 stays away
    stage = PipelineStage(nn.Linear(4, 4), g.rank, 2, "cpu", group=g, input_args=torch.zeros(2, 4))
    schedule = get_schedule("1f1b")(stage, 4, loss_fn=F.mse_loss)
    if g.rank == 0:
        return "idle"
    try:
        schedule.step(target=torch.zeros(8, 4))
    except Exception as error:  # noqa: BLE001 - the message is the result
        return f"{type(error).__name__}: {error}"
    return "no error"


def with_ddp(name: str, n_microbatches: int) -> dict[str, Any]:
    """Pipeline over "pp", DDP over "dp" on a (2, 2) mesh; each dp replica gets half the batch."""
    from spmd.parallel import DistributedDataParallel

    if name.startswith("test_"):
        _use_test_schedules()
    mesh = spmd.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh.get_group("pp"), mesh.get_group("dp")
    pieces = split_module(make_model(2), num_stages=2)
    piece = pieces[pp.rank]
    ddp = DistributedDataParallel(piece, process_group=dp)
    stage = PipelineStage(ddp, pp.rank, 2, "cpu", group=pp)
    schedule = get_schedule(name)(stage, n_microbatches, loss_fn=F.mse_loss)
    x, y = make_batch()
    half = slice(dp.rank * BATCH // 2, (dp.rank + 1) * BATCH // 2)
    losses: list[torch.Tensor] = []
    if pp.rank == 0:
        schedule.step(x[half])
    else:
        schedule.step(target=y[half], losses=losses)
    return {"stage": pp.rank, "grads": [p.grad.tolist() for p in piece.parameters()]}


def with_fsdp(name: str, n_microbatches: int) -> dict[str, Any]:
    """Pipeline over "pp", FSDP over "dp" (each Linear a unit, then the stage) on a (2, 2) mesh."""
    from spmd.parallel import fully_shard

    mesh = spmd.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh.get_group("pp"), mesh.get_group("dp")
    piece = split_module(make_model(2), num_stages=2)[pp.rank]
    for layer in piece:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh["dp"])
    fully_shard(piece, mesh=mesh["dp"])
    try:
        schedule = get_schedule(name)(PipelineStage(piece, pp.rank, 2, "cpu", group=pp), n_microbatches, loss_fn=F.mse_loss)
    except ValueError as error:
        return {"stage": pp.rank, "error": str(error)}
    x, y = make_batch()
    half = slice(dp.rank * BATCH // 2, (dp.rank + 1) * BATCH // 2)
    if pp.rank == 0:
        schedule.step(x[half])
    else:
        schedule.step(target=y[half], losses=[])
    grads = [p.grad.full_tensor().tolist() for p in piece.parameters()]  # sharded over dp: gathered to compare
    return {"stage": pp.rank, "grads": grads, "sharded": [str(p.placements) for p in piece.parameters()][:1]}
