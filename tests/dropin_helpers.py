"""Rank functions for test_dtensor_dropin.py: views, in-place writes, kernels that conjugate inside, factories."""

from __future__ import annotations

from typing import Any

import torch
from dtensor_helpers import _error  # (one error-as-text helper for the DTensor tests)

import spmd
from spmd import Replicate, Shard
from spmd.tensor.visualize import sharding_table


def views_and_writes() -> dict[str, Any]:
    """A view that aliases its DTensor takes writes; one taken of a redistributed copy refuses them."""
    mesh = spmd.init_device_mesh("cpu", (spmd.get_world_size(),))
    full = torch.arange(16.0).reshape(4, 4)
    x = spmd.distribute_tensor(full, mesh, [Shard(0)])
    x.view(4, 2, 2).mul_(2)  # the shard survives the view: the write reaches x
    x[:, 1:3].add_(1)  # a slice off the sharded dimension: also a view of each shard
    expected = full * 2
    expected[:, 1:3] += 1
    y = spmd.distribute_tensor(full, mesh, [Shard(1)])
    z = spmd.distribute_tensor(full, mesh, [Shard(1)])
    return {
        "aliasing_view": bool(torch.equal(x.full_tensor(), expected)),
        "detached": _error(lambda: y.diagonal().mul_(0.5)),  # diagonal gathers the columns first
        "row_slice": _error(lambda: x[1:3].add_(1)),  # a slice along the sharded dimension gathers the rows
        "y_kept": bool(torch.equal(y.full_tensor(), full)),
        "copy_is_fine": bool(torch.equal(z.diagonal().clone().mul_(0.5).full_tensor(), full.diagonal() * 0.5)),
        "in_place_views": in_place_views(mesh, full),
        "as_strided_": _error(lambda: spmd.distribute_tensor(full, mesh, [Replicate()]).as_strided_((2, 8), (8, 1))),
    }


def in_place_views(mesh: Any, full: torch.Tensor) -> bool:
    """unsqueeze_, t_, squeeze_ and transpose_ change the DTensor itself (shape, strides, placements), as torch's."""
    x = spmd.distribute_tensor(full, mesh, [Shard(0)])
    x.unsqueeze_(0)
    ok = x.shape == (1, 4, 4) and x.placements == (Shard(1),) and torch.equal(x.full_tensor(), full.unsqueeze(0))
    x.squeeze_(0).t_()
    ok = ok and x.shape == (4, 4) and x.stride() == (1, 4) and torch.equal(x.full_tensor(), full.t())
    x.transpose_(0, 1).mul_(2)  # still a view of the same shard: the write lands in its memory
    return ok and x.placements == (Shard(0),) and torch.equal(x.full_tensor(), full * 2)


def kernels_that_conjugate_inside() -> dict[str, float]:
    """linalg.pinv and friends build conjugate views inside their kernels; torch hides the Conjugate key while a
    subclass dispatches, which made them read the views unresolved."""
    mesh = spmd.init_device_mesh("cpu", (spmd.get_world_size(),))
    torch.manual_seed(0)
    a = torch.randn(5, 5, dtype=torch.complex64)
    d = spmd.distribute_tensor(a, mesh, [Replicate()])
    s = spmd.distribute_tensor(torch.randn(4, 5, 5, dtype=torch.complex64), mesh, [Shard(0)])
    return {
        "pinv": float((torch.linalg.pinv(d).full_tensor() - torch.linalg.pinv(a)).abs().max()),
        "pinv_batched": float((torch.linalg.pinv(s).full_tensor() - torch.linalg.pinv(s.full_tensor())).abs().max()),
        "lstsq_solution": float(
            (torch.linalg.solve(d, d.mH).full_tensor() - torch.linalg.solve(a, a.mH)).abs().max()
        ),
    }


def factories_and_distribute_module() -> dict[str, Any]:
    """spmd.tensor's factories and distribute_module against torch's own in the same world."""
    import torch.distributed.tensor as ttensor
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh

    import spmd.tensor as stensor

    mesh, tmesh = spmd.init_device_mesh("cpu", (2,)), torch_mesh("cpu", (2,))
    same = {}
    for name, args in (("zeros", (5, 3)), ("ones", ((4, 2),)), ("full", ((3, 4), 2.5))):
        ours = getattr(stensor, name)(*args, device_mesh=mesh, placements=[Shard(0)])
        theirs = getattr(ttensor, name)(*args, device_mesh=tmesh, placements=[ttensor.Shard(0)])
        same[name] = (torch.equal(ours.full_tensor(), theirs.full_tensor()) and ours.to_local().shape == theirs.to_local().shape)
    torch.manual_seed(spmd.get_rank())  # ranks seeded differently: the replicas must still agree
    r = stensor.randn(4, 4, device_mesh=mesh, placements=[Replicate()])
    gathered = [torch.empty(4, 4) for _ in range(2)]
    spmd.all_gather(gathered, r.to_local())
    torch.manual_seed(0)
    sharded = stensor.rand(6, 2, device_mesh=mesh, placements=[Shard(0)], requires_grad=True)

    def partition(name: str, module: torch.nn.Module, m: Any) -> None:
        if isinstance(module, torch.nn.Linear) and name == "0":
            module.weight = torch.nn.Parameter(spmd.distribute_tensor(module.weight, m, [Shard(0)]))

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    reference = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    reference.load_state_dict(model.state_dict())
    stensor.distribute_module(
        model, mesh, partition,
        input_fn=lambda mod, inputs, m: tuple(spmd.distribute_tensor(x, m, [Replicate()]) for x in inputs),
        output_fn=lambda mod, out, m: out.full_tensor(),
    )
    x = torch.randn(3, 4)
    return {
        **same,
        "rand_replicas_agree": bool(torch.equal(gathered[0], gathered[1])),
        "rand_grad": sharded.requires_grad and sharded.placements == (Shard(0),),
        "module_out": bool(torch.allclose(model(x), reference(x))),
        "placements": [str(p.placements) for p in model.parameters()],
        "twice": _error(lambda: stensor.distribute_module(model, mesh)),
        "table": sharding_table(spmd.distribute_tensor(torch.zeros(4, 4), mesh, [Shard(0)])),
        "table_replicated": sharding_table(spmd.distribute_tensor(torch.zeros(3), mesh, [Replicate()])),
    }
