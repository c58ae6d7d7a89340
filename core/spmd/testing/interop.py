"""The torch.distributed interop suite: torch's API, DDP and functional collectives on a spmd backend.

Every backend plugin can run it against itself, as with the conformance suite::

    from spmd.testing.interop import TorchInteropSuite

    class TestMineInterop(TorchInteropSuite):
        backend = "mine"

Each check runs on real ranks (the ``spmd_world`` fixture) and compares what
torch.distributed computes on spmd's group (torch's default group after
``spmd.init``) with what it computes on a torch Gloo group over the same ranks.
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar

import torch
import torch.distributed as tdist
from torch import nn

_GLOO: list[Any] = []


def gloo_group() -> Any:
    """A torch Gloo group over every rank, created once per process (every rank calls it alike)."""
    if not _GLOO:
        _GLOO.append(tdist.new_group(backend="gloo"))
    return _GLOO[0]


def torch_view() -> dict[str, Any]:
    """What a library that asks torch.distributed sees after spmd.init."""
    from torch.utils.data import DistributedSampler

    sampler: DistributedSampler[int] = DistributedSampler(list(range(10)), shuffle=False)  # type: ignore[arg-type]
    return {
        "initialized": tdist.is_initialized(),
        "rank": tdist.get_rank(),
        "world": tdist.get_world_size(),
        "backend": tdist.get_backend(),
        "sampler": list(sampler),
    }


def _ops(rank: int, world: int) -> dict[str, Any]:
    """One round of torch.distributed calls on the default group and, for comparison, on Gloo."""
    results: dict[str, Any] = {}
    for side, group in (("spmd", None), ("gloo", gloo_group())):
        out: dict[str, Any] = {}
        g = torch.Generator().manual_seed(rank)
        base = torch.randn(6, generator=g)
        for op in ("SUM", "MAX", "MIN", "PRODUCT"):
            t = base.clone()
            tdist.all_reduce(t, getattr(tdist.ReduceOp, op), group=group)
            out[f"all_reduce.{op}"] = t
        ints = torch.arange(4, dtype=torch.int64) + rank
        tdist.all_reduce(ints, tdist.ReduceOp.BXOR, group=group)
        out["all_reduce.BXOR"] = ints
        gathered = torch.empty(6 * world)
        tdist.all_gather_single(gathered, base, group=group)
        out["all_gather_single"] = gathered
        parts = [torch.empty(6) for _ in range(world)]
        tdist.all_gather(parts, base, group=group)
        out["all_gather"] = torch.stack(parts)
        shapes = [(2,), (3, 2)] + [(1,)] * world  # more tensors than ranks, of several shapes
        ins = [torch.full(shape, float(10 * rank + i)) for i, shape in enumerate(shapes)]
        rows = [[torch.empty(shape) for shape in shapes] for _ in range(world)]
        tdist.all_gather_coalesced(rows, ins, group=group)  # rows[r][i] = rank r's ins[i]
        out["all_gather_coalesced"] = torch.cat([t.flatten() for row in rows for t in row])
        shard = torch.empty(3)
        tdist.reduce_scatter_single(shard, torch.randn(3 * world, generator=g), group=group)
        out["reduce_scatter_single"] = shard
        piece = torch.empty(2)
        tdist.reduce_scatter(piece, [torch.randn(2, generator=g) for _ in range(world)], group=group)
        out["reduce_scatter"] = piece
        b = base.clone()
        tdist.broadcast(b, src=world - 1, group=group)
        out["broadcast"] = b
        r = base.clone()
        tdist.reduce(r, dst=0, group=group)
        out["reduce"] = r if rank == 0 else torch.zeros(0)
        gl = [torch.empty(6) for _ in range(world)] if rank == 0 else None
        tdist.gather(base, gl, dst=0, group=group)
        out["gather"] = torch.stack(gl) if gl else torch.zeros(0)
        sc = torch.empty(2)
        tdist.scatter(sc, [torch.full((2,), float(i)) for i in range(world)] if rank == 0 else None, src=0, group=group)
        out["scatter"] = sc
        a2a = torch.empty(2 * world)
        tdist.all_to_all_single(a2a, torch.arange(2.0 * world) + 100 * rank, group=group)
        out["all_to_all_single"] = a2a
        lists = [torch.empty(2) for _ in range(world)]  # Gloo's all_to_all takes even sizes only
        tdist.all_to_all(lists, [torch.full((2,), float(10 * rank + i)) for i in range(world)], group=group)
        out["all_to_all"] = torch.cat(lists)
        p = torch.full((3,), float(rank))
        if rank == 0:
            tdist.send(p, 1, group=group)
        elif rank == 1:
            tdist.recv(p, 0, group=group)
        out["send_recv"] = p
        work = tdist.all_reduce(base.clone(), group=group, async_op=True)
        assert work is not None
        work.wait()
        tdist.barrier(group=group)
        results[side] = out
    return results


def collectives_match_gloo() -> list[str]:
    """The ops of ``_ops`` on spmd's default group and on Gloo; the names of those that differ."""
    import torch.distributed._functional_collectives as fc

    rank, world = tdist.get_rank(), tdist.get_world_size()
    results = _ops(rank, world)
    differ = [name for name, t in results["spmd"].items() if not torch.equal(t, results["gloo"][name])]
    # Functional collectives (DTensor, torch.compile's path) resolve the group by name in C++.
    x = torch.arange(4.0) + rank
    world_group = tdist.group.WORLD
    assert world_group is not None
    pairs = {
        "fc.all_reduce": (fc.all_reduce(x, "sum", world_group), fc.all_reduce(x, "sum", gloo_group())),
        "fc.all_gather_tensor": (fc.all_gather_tensor(x, 0, world_group), fc.all_gather_tensor(x, 0, gloo_group())),
        "fc.reduce_scatter_tensor": (
            fc.reduce_scatter_tensor(x, "sum", 0, world_group),
            fc.reduce_scatter_tensor(x, "sum", 0, gloo_group()),
        ),
    }
    differ += [name for name, (a, b) in pairs.items() if not torch.equal(torch.as_tensor(a), torch.as_tensor(b))]
    # torch.distributed.new_group makes a spmd group too.
    sub = tdist.new_group([0, 1])
    t = torch.ones(2) * (rank + 1)
    if rank in (0, 1):
        tdist.all_reduce(t, group=sub)
        if not torch.equal(t, torch.full((2,), 3.0)) or tdist.get_backend(sub) != "spmd":
            differ.append("new_group")
    return differ


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)
        self.bn = nn.BatchNorm1d(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def ddp_matches_gloo(steps: int = 4) -> bool:
    """torch's own DDP on spmd's default group trains bit-identically to torch's DDP on Gloo."""
    rank = tdist.get_rank()
    torch.manual_seed(10 + rank)  # different per rank: DDP must broadcast rank 0's parameters
    base = _Net()
    ours = nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.001)
    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.001, process_group=gloo_group())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
        for model, opt in zip((ours, theirs), opts):
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    same = all(torch.equal(p, q) for p, q in zip(ours.module.state_dict().values(), theirs.module.state_dict().values()))
    return same


class TorchInteropSuite:
    """torch.distributed on spmd's backend, 2 real ranks; subclass and set ``backend``."""

    backend: ClassVar[str]
    world_size: ClassVar[int] = 2

    def test_libraries_that_ask_torch_see_spmd(self, spmd_world: Any) -> None:
        views = spmd_world(self.world_size, self.backend).run(torch_view)
        assert [v["rank"] for v in views] == list(range(self.world_size))
        assert {v["world"] for v in views} == {self.world_size} and {v["backend"] for v in views} == {"spmd"}
        samples = sorted(i for v in views for i in v["sampler"])
        assert samples == list(range(10)), "DistributedSampler(ds) must split the data set over the ranks"

    def test_torch_collectives_equal_torch_on_gloo(self, spmd_world: Any) -> None:
        differ = spmd_world(self.world_size, self.backend).run(collectives_match_gloo)
        assert differ == [[]] * self.world_size

    def test_torch_ddp_equals_torch_ddp_on_gloo(self, spmd_world: Any) -> None:
        assert spmd_world(self.world_size, self.backend).run(ddp_matches_gloo) == [True] * self.world_size
