"""Rank functions for test_checkpoint.py (pickled by reference, run on every rank)."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

import spmd
import spmd.checkpoint as dcp
from spmd import Replicate, Shard
from spmd.tensor import DTensor

PLUGIN = "checkpoint-test-storage"


def use_test_storage() -> None:
    """Register the test storage plugin in this process (once) and drop the cached scheme registry."""
    import checkpoint_plugin

    from spmd.checkpoint import storage
    from spmd.plugins import manager

    pm = manager()
    if pm.get_plugin(PLUGIN) is None:
        pm.register(checkpoint_plugin, name=PLUGIN)
    storage.reset()


def full_values() -> dict[str, torch.Tensor]:
    """The global tensors every test saves, the same on every rank."""
    g = torch.Generator().manual_seed(20)
    return {
        "w": torch.randn(10, 6, generator=g),  # 10 rows over 4 ranks: 3, 3, 3, 1
        "m": torch.randn(7, 5, generator=g),
        "bf": torch.randn(3, 9, generator=g).to(torch.bfloat16),
        "ids": torch.randint(0, 100, (13,), generator=g),
        "rep": torch.randn(3, 3, generator=g),
        **{f"plain{i}": torch.randn(64, generator=g) for i in range(4)},
    }


def extras() -> dict[str, Any]:
    """Non-tensor values: a step counter, scheduler state, a data-loader position, an RNG state tensor."""
    return {
        "step": 17,
        "sched": {"milestones": [3, 5], "gamma": 0.5, "last_epoch": 4},
        "loader": {"epoch": 2, "position": 1234, "name": "shard-7"},
        "rng": torch.Generator().manual_seed(5).get_state(),
    }


def state_on_four(layout: str) -> dict[str, Any]:
    """The saved state on 4 ranks: a 1-D mesh and a 2x2 mesh, uneven and nested shards."""
    full = full_values()
    mesh = spmd.init_device_mesh("cpu", (4,))
    grid = spmd.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    state: dict[str, Any] = {
        "model": {
            "w": spmd.distribute_tensor(full["w"], mesh, [Shard(0)], src_data_rank=None),
            "m": spmd.distribute_tensor(full["m"], grid, [Shard(0), Shard(1)] if layout == "nested" else [Shard(1), Shard(1)], src_data_rank=None),
            "bf": spmd.distribute_tensor(full["bf"], grid, [Replicate(), Shard(1)], src_data_rank=None),
            "ids": spmd.distribute_tensor(full["ids"], mesh, [Shard(0)], src_data_rank=None),
            "rep": spmd.distribute_tensor(full["rep"], mesh, [Replicate()], src_data_rank=None),
        },
        "plain": [full[f"plain{i}"].clone() for i in range(4)],
    }
    state.update(extras())
    return state


def save_on_four(path: str, layout: str = "nested") -> dict[str, Any]:
    """Save the state from 4 ranks; report the seconds and which rank wrote what."""
    state = state_on_four(layout)
    start = time.perf_counter()
    dcp.save(state, checkpoint_id=path)
    return {"seconds": time.perf_counter() - start}


def _empty_like_target(mesh: Any, placements: dict[str, list]) -> dict[str, Any]:
    full = full_values()
    model = {}
    for key in ("w", "m", "bf", "ids", "rep"):
        zeros = torch.zeros_like(full[key])
        model[key] = spmd.distribute_tensor(zeros, mesh, placements[key], src_data_rank=None) if mesh else zeros
    return {
        "model": model,
        "plain": [torch.zeros(64) for _ in range(4)],
        "step": 0,
        "sched": {"milestones": [], "gamma": 1.0, "last_epoch": -1},
        "loader": {"epoch": 0, "position": 0, "name": ""},
        "rng": torch.zeros_like(extras()["rng"]),
    }


def _check(state: dict[str, Any]) -> dict[str, bool]:
    full = full_values()
    out = {}
    for key in ("w", "m", "bf", "ids", "rep"):
        value = state["model"][key]
        got = value.full_tensor() if isinstance(value, DTensor) else value
        out[key] = bool(torch.equal(got, full[key])) and got.dtype == full[key].dtype
    out["plain"] = all(torch.equal(state["plain"][i], full[f"plain{i}"]) for i in range(4))
    want = extras()
    for key in ("step", "sched", "loader"):
        out[key] = state[key] == want[key]
    out["rng"] = bool(torch.equal(state["rng"], want["rng"]))
    return out


def load_on_two(path: str) -> dict[str, Any]:
    """Load on 2 ranks with other placements: Shard(1) where 4 ranks had Shard(0), replicated, sharded."""
    mesh = spmd.init_device_mesh("cpu", (2,))
    placements = {"w": [Shard(1)], "m": [Replicate()], "bf": [Shard(0)], "ids": [Shard(0)], "rep": [Shard(1)]}
    state = _empty_like_target(mesh, placements)
    dcp.load(state, checkpoint_id=path)
    result = _check(state)
    result["w_local"] = state["model"]["w"].to_local().shape
    return result


def load_plain(path: str) -> dict[str, Any]:
    """Load as plain tensors (1 rank, or one process without spmd.init)."""
    state = _empty_like_target(None, {})
    dcp.load(state, checkpoint_id=path)
    return _check(state)


# -- optimizer state ---------------------------------------------------------------------------------


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 4)
        self.register_buffer("scale", torch.tensor([1.5]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x))) * self.scale


def _tp_net(world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from spmd.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    net = Net()
    mesh = spmd.init_device_mesh("cpu", (world,))
    parallelize_module(net, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    return net, torch.optim.AdamW(net.parameters(), lr=0.01, betas=(0.8, 0.9))


def _train(net: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(5, 6, generator=g)
        net(x).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def _full(sd: dict[str, Any]) -> dict[str, Any]:
    from spmd.checkpoint.flatten import leaves

    return {leaf.key: (leaf.value.full_tensor() if isinstance(leaf.value, DTensor) else leaf.value) for leaf in leaves(sd)}


def save_tp_training(path: str) -> dict[str, Any]:
    """Train a tensor-parallel model 3 steps, save model, optimizer and step; report the full values."""
    net, optimizer = _tp_net(spmd.get_world_size())
    _train(net, optimizer, 3)
    model_sd, optim_sd = dcp.get_state_dict(net, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd, "step": 3}, checkpoint_id=path)
    return {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in _full({"model": model_sd, "optim": optim_sd}).items()}


def resume_ddp(path: str) -> dict[str, Any]:
    """Load the tensor-parallel checkpoint into a DDP model of another world size, and its fresh optimizer."""
    torch.manual_seed(1)
    net = spmd.parallel.DistributedDataParallel(Net())
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.5, betas=(0.1, 0.2))
    model_sd, optim_sd = dcp.get_state_dict(net, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "step": 0}
    dcp.load(state, checkpoint_id=path)
    dcp.set_state_dict(net, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    again_model, again_optim = dcp.get_state_dict(net, optimizer)
    flat = _full({"model": again_model, "optim": again_optim})
    return {
        "values": {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in flat.items()},
        "step": state["step"],
        "keys": sorted(model_sd),
        "betas": optimizer.param_groups[0]["betas"],
    }


# -- failures and async --------------------------------------------------------------------------------


def save_then_fail(good: str, bad: str) -> dict[str, Any]:
    """Save once to ``good``, then again to the same directory through a storage that fails on rank 1."""
    use_test_storage()
    state = {"x": torch.arange(8.0), "y": torch.arange(8.0), "step": 1}  # two writers: one tensor each
    dcp.save(state, checkpoint_id=good)
    try:
        dcp.save({"x": torch.arange(8.0) * 100, "y": torch.zeros(8), "step": 2}, checkpoint_id=bad)
        error = "no error"
    except dcp.CheckpointError as e:
        error = str(e)
    loaded = {"x": torch.zeros(8), "step": 0}
    dcp.load(loaded, checkpoint_id=good)
    return {"error": error, "x": loaded["x"].tolist(), "step": loaded["step"]}


def async_vs_sync(async_path: str, sync_path: str) -> dict[str, Any]:
    """async_save, then change the tensors at once (training goes on); a sync save of the old values equals it."""
    mesh = spmd.init_device_mesh("cpu", (spmd.get_world_size(),))
    full = full_values()
    w = spmd.distribute_tensor(full["w"], mesh, [Shard(0)], src_data_rank=None)
    state = {"w": w, "p": full["plain0"].clone(), "step": 7}
    start = time.perf_counter()
    future = dcp.async_save(state, checkpoint_id=async_path)
    blocked = time.perf_counter() - start
    with torch.no_grad():
        w._local_tensor.add_(1000.0)
        state["p"].add_(1000.0)
    spmd.all_reduce(torch.ones(1))  # the caller's collectives go on while the save writes
    future.result(timeout=60)
    second = dcp.async_save({"w": w, "p": state["p"], "step": 8}, checkpoint_id=async_path + "-2")
    original = {"w": spmd.distribute_tensor(full["w"], mesh, [Shard(0)], src_data_rank=None), "p": full["plain0"], "step": 7}
    dcp.save(original, checkpoint_id=sync_path)  # waits for the second async save first
    return {"blocked": blocked, "second_done": second.done(), "second": second.result() is not None}


def load_two_and_compare(a: str, b: str) -> dict[str, Any]:
    """Load two checkpoints of the same keys into plain tensors and compare."""
    out = []
    for path in (a, b):
        state = {"w": torch.zeros(10, 6), "p": torch.zeros(64), "step": 0}
        dcp.load(state, checkpoint_id=path)
        out.append(state)
    return {
        "equal": all(torch.equal(out[0][k], out[1][k]) for k in ("w", "p")) and out[0]["step"] == out[1]["step"],
        "w_ok": torch.equal(out[0]["w"], full_values()["w"]),
        "diff": {k: (out[0][k] - out[1][k]).abs().max().item() for k in ("w", "p")},
        "steps": (out[0]["step"], out[1]["step"]),
    }


def third_party_roundtrip(path: str) -> dict[str, Any]:
    """Save and load through the test plugin's ``flat://`` scheme on every rank."""
    use_test_storage()
    mesh = spmd.init_device_mesh("cpu", (spmd.get_world_size(),))
    full = full_values()
    state = {"w": spmd.distribute_tensor(full["w"], mesh, [Shard(0)], src_data_rank=None), "n": 3}
    dcp.save(state, checkpoint_id=f"flat://{path}")
    target = {"w": spmd.distribute_tensor(torch.zeros(10, 6), mesh, [Shard(1)], src_data_rank=None), "n": 0}
    dcp.load(target, checkpoint_id=f"flat://{path}")
    import checkpoint_plugin

    before = checkpoint_plugin.BYTES_READ[0]
    rows = {"w": spmd.distribute_tensor(torch.zeros(10, 6), mesh, [Shard(0)], src_data_rank=None)}
    dcp.load(rows, checkpoint_id=f"flat://{path}")
    return {
        "equal": bool(torch.equal(target["w"].full_tensor(), full["w"])) and bool(torch.equal(rows["w"].full_tensor(), full["w"])),
        "n": target["n"],
        "bytes_read": checkpoint_plugin.BYTES_READ[0] - before,
    }


def full_and_sharded_state_dicts() -> dict[str, Any]:
    """full_state_dict gathers DTensors; a full state dict loads into a sharded model (and back)."""
    net, optimizer = _tp_net(spmd.get_world_size())
    _train(net, optimizer, 2)
    options = dcp.StateDictOptions(full_state_dict=True)
    full_model, full_optim = dcp.get_state_dict(net, optimizer, options=options)
    plain_types = all(not isinstance(v, DTensor) for v in full_model.values())
    fresh, fresh_optimizer = _tp_net(spmd.get_world_size())
    dcp.set_state_dict(fresh, fresh_optimizer, model_state_dict=full_model, optim_state_dict=full_optim)
    again_model, again_optim = dcp.get_state_dict(fresh, fresh_optimizer, options=options)
    sharded, _ = dcp.get_state_dict(fresh, fresh_optimizer)
    return {
        "plain": plain_types,
        "sharded": isinstance(sharded["fc1.weight"], DTensor),
        "model_equal": all(torch.equal(full_model[k], again_model[k]) for k in full_model),
        "optim_equal": all(
            torch.equal(full_optim["state"][p][k], again_optim["state"][p][k]) for p in full_optim["state"] for k in full_optim["state"][p]
        ),
    }


def one_rank_refuses(path: str) -> str:
    """Rank 0 alone holds a value that is not JSON (rank 0 writes the values): every rank raises, none waits."""
    state = {"x": torch.ones(2), "bad": object() if spmd.get_rank() == 0 else 1}
    try:
        dcp.save(state, checkpoint_id=path)
    except dcp.CheckpointError as error:
        return str(error)
    return "no error"


def async_save_failure(path: str) -> str:
    """An async save through a failing storage: its future raises."""
    use_test_storage()
    future = dcp.async_save({"x": torch.arange(4.0), "y": torch.ones(4)}, checkpoint_id=f"failing://{path}")
    try:
        future.result(timeout=60)
    except dcp.CheckpointError as error:
        return str(error)
    return "no error"


def a_rank_that_cannot_stage(path: str) -> str:
    """async_save where rank 1's copy into its staging buffer fails: every rank's future raises naming rank 1."""
    import importlib

    module = importlib.import_module("spmd.checkpoint.async_save")  # (the package's async_save is the function)

    class OutOfMemory(module.Stager):
        def __call__(self, key: str, box: Any, local: torch.Tensor) -> torch.Tensor:
            raise MemoryError("cannot allocate the staging buffer (simulated)")

    original = module._stager
    if spmd.get_rank() == 1:
        module._stager = OutOfMemory()
    try:
        future = dcp.async_save({"x": torch.arange(4.0), "y": torch.ones(4)}, checkpoint_id=path)  # one writer each
        try:
            future.result(timeout=30)
        except dcp.CheckpointError as error:
            return str(error)
        return "no error"
    finally:
        module._stager = original


def unasked_async_failure(path: str, after: str) -> str:
    """An async save that fails while nobody asks its future: the next save raises its error."""
    use_test_storage()
    dcp.async_save({"x": torch.arange(4.0), "y": torch.ones(4)}, checkpoint_id=f"failing://{path}")
    try:
        dcp.save({"x": torch.arange(4.0)}, checkpoint_id=after)
    except dcp.CheckpointError as error:
        dcp.save({"x": torch.arange(4.0)}, checkpoint_id=after)  # reported once: the next save goes ahead
        return str(error)
    return "no error"


def partial_targets(path: str) -> dict[str, Any]:
    """Load and assign a stored full value into Partial DTensors of every reduce op; each must reduce to the value."""
    from spmd import Partial
    from spmd.checkpoint.state_dict import assign

    mesh = spmd.init_device_mesh("cpu", (spmd.get_world_size(),))
    value = torch.linspace(-3.0, 5.0, 12).reshape(3, 4)  # negative and positive: max(v, 0) or min(v, 0) would show
    dcp.save({"v": value}, checkpoint_id=path)
    out = {}
    for op in ("sum", "avg", "max", "min"):
        loaded = spmd.distribute_tensor(torch.full((3, 4), 99.0), mesh, [Partial(op)], src_data_rank=None)
        dcp.load({"v": loaded}, checkpoint_id=path)
        assigned = spmd.distribute_tensor(torch.full((3, 4), 99.0), mesh, [Partial(op)], src_data_rank=None)
        assign(assigned, value)
        out[op] = (bool(torch.equal(loaded.full_tensor(), value)), bool(torch.equal(assigned.full_tensor(), value)))
    return out


def save_then_die(good: str, bad: str) -> None:
    """Save to ``good``, then again through a storage whose rank 1 dies half-way (rank 0 then fails too)."""
    use_test_storage()
    dcp.save({"x": torch.arange(8.0), "y": torch.arange(8.0), "step": 1}, checkpoint_id=good)
    dcp.save({"x": torch.zeros(8), "y": torch.zeros(8), "step": 2}, checkpoint_id=bad)


def set_model_state_dict_into_meta_fully_shard() -> dict:
    """pytorch/examples' FSDP2 resume: fully_shard on the meta device, then set_model_state_dict with a full
    state dict (broadcast_from_rank0, and every rank holding it), without to_empty. copy_ into a meta tensor
    does nothing, so the values used to be dropped silently; now they replace the meta tensors, as in torch."""
    from spmd.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from spmd.fsdp import fully_shard

    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
    full = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    out: dict[str, Any] = {}
    for how in ("broadcast_from_rank0", "full_state_dict"):
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
        fully_shard(model[0])
        fully_shard(model)
        rank0 = how == "broadcast_from_rank0"
        given = full if not rank0 or spmd.get_rank() == 0 else {}
        set_model_state_dict(model, given, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=rank0))
        params = dict(model.named_parameters())
        x = torch.ones(3, 4)
        out[how] = {
            "meta": any(p.to_local().is_meta for p in params.values()),
            "same_values": all(torch.equal(params[k].full_tensor(), v) for k, v in full.items()),
            "forward": torch.allclose(model(x), reference(x)),
        }
    return out


# -- untrusted checkpoints (test_checkpoint_untrusted.py) -------------------------------------------------


def small_state() -> dict[str, Any]:
    """What test_checkpoint_untrusted saves: a row-sharded matrix (one chunk per rank), a plain tensor, values."""
    return {"w": torch.arange(12.0).reshape(4, 3), "ids": torch.arange(5) * 7, "step": 3, "cfg": {"lr": 0.5}}


def save_small_on_two(path: str) -> None:
    """Save small_state() from 2 ranks, ``w`` as Shard(0): two rank files, ``w`` in two chunks."""
    mesh = spmd.init_device_mesh("cpu", (2,))
    state = small_state()
    state["w"] = spmd.distribute_tensor(state["w"], mesh, [Shard(0)], src_data_rank=None)
    dcp.save(state, checkpoint_id=path)


def load_small_on_two(path: str, secret: bytes) -> dict[str, Any]:
    """Load a (tampered) small checkpoint into Shard(1) tensors: the error, its seconds, whether ``secret`` got in."""
    mesh = spmd.init_device_mesh("cpu", (2,))
    state = {"w": spmd.distribute_tensor(torch.zeros(4, 3), mesh, [Shard(1)], src_data_rank=None),
             "ids": torch.zeros(5, dtype=torch.int64), "step": 0, "cfg": {"lr": 0.0}}
    start = time.perf_counter()
    try:
        dcp.load(state, checkpoint_id=path)
        error = None
    except dcp.CheckpointError as e:
        error = str(e)
    seconds = time.perf_counter() - start
    held = state["w"].to_local().contiguous().numpy().tobytes() + state["ids"].numpy().tobytes()
    return {"error": error, "seconds": seconds, "secret_seen": secret[:8] in held}


# -- writers: one per checkpoint id, no save lost (test_checkpoint_writers.py) ------------------------------


def writer_state(seed: int) -> dict[str, Any]:
    """A small state that tells saves apart: two tensors (one writer each on 2 ranks) and the seed as the step."""
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(6, 4, generator=g), "y": torch.randn(9, generator=g), "step": seed}


def load_writer_state(path: str) -> dict[str, Any]:
    """Load a ``writer_state`` checkpoint into zeros (one process, plain tensors)."""
    state = {"x": torch.zeros(6, 4), "y": torch.zeros(9), "step": -1}
    dcp.load(state, checkpoint_id=path)
    return state


def same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two ``writer_state`` dicts hold equal tensors and steps."""
    return torch.equal(a["x"], b["x"]) and torch.equal(a["y"], b["y"]) and a["step"] == b["step"]


def save_or_error(path: str, seed: int) -> str:
    """Save ``writer_state(seed)`` on every rank; the error's type and message, or "saved"."""
    try:
        dcp.save(writer_state(seed), checkpoint_id=path)
    except dcp.CheckpointError as error:
        return f"{type(error).__name__}: {error}"
    return "saved"
