"""Rank functions for test_ddp.py: spmd DDP against torch DDP (both over Gloo) in one process."""

from __future__ import annotations

import copy
import time
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import spmd
from spmd.comm.state import get_state
from spmd.parallel import DistributedDataParallel as DDP
from spmd.parallel import comm_hooks

STEPS = 20


class Net(nn.Module):
    """A small MLP; ``extra`` is used only when the forward asks for it, ``bn`` adds buffers."""

    def __init__(self, extra: bool = False, bn: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.bn = nn.BatchNorm1d(32) if bn else None
        self.fc2 = nn.Linear(32, 32)
        self.extra = nn.Linear(32, 32) if extra else None
        self.fc3 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        if self.bn is not None:
            h = self.bn(h)
        h = torch.relu(self.fc2(h))
        if self.extra is not None and use_extra:
            h = h + torch.tanh(self.extra(h))
        return self.fc3(h)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data rank ``rank`` sees at ``step`` (every rank can rebuild every other's)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


_GLOO: list[Any] = []


def _torch_group() -> Any:
    """A torch.distributed Gloo group over every rank (torch's default group is spmd's own under interop)."""
    if not tdist.is_initialized():
        store = tdist.PrefixStore("torch-ddp/", get_state().store)
        tdist.init_process_group("gloo", store=store, rank=spmd.get_rank(), world_size=spmd.get_world_size())
    if not _GLOO:
        _GLOO.append(tdist.group.WORLD if tdist.get_backend() == "gloo" else tdist.new_group(backend="gloo"))
    return _GLOO[0]


def _uses_extra(case: str, step: int, rank: int) -> bool:
    if case != "unused":
        return True
    if step % 4 == 1:
        return False  # no rank uses it: its gradient must stay None everywhere
    return rank == 0 or step % 3 == 0  # only some ranks use it


def parity(case: str) -> dict[str, Any]:
    """Train one model with spmd DDP and a copy with torch DDP for STEPS SGD steps; compare."""
    gloo = _torch_group()
    rank = spmd.get_rank()
    torch.manual_seed(100 + rank)  # different on every rank: both wrappers must broadcast rank 0's
    base = Net(extra=case == "unused", bn=case == "plain")
    options: dict[str, Any] = {}
    if case == "unused":
        options["find_unused_parameters"] = True
    if case == "buckets":
        options["bucket_cap_mb"] = 0.0005  # 512 B: about one parameter per bucket
    ours = DDP(copy.deepcopy(base), **options)
    theirs = TorchDDP(copy.deepcopy(base), process_group=gloo, **options)
    hook = {"fp16": "fp16", "bf16": "bf16"}.get(case)
    if hook is not None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        def torch_hook(process_group, bucket):  # no annotations: torch checks them
            # torch's own compress hook (its bf16 wrapper refuses CPU, the shared body does not)
            return default_hooks._compress_hook(torch.float16 if hook == "fp16" else torch.bfloat16, process_group, bucket)

        ours.register_comm_hook(None, hook)
        theirs.register_comm_hook(None, torch_hook)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ours, theirs)]
    for step in range(STEPS):
        x, y = batch(step, rank)
        accumulate = case == "no_sync" and step % 2 == 0
        for model in (ours, theirs):
            with model.no_sync() if accumulate else nullcontext():
                out = model(x, use_extra=_uses_extra(case, step, rank))
                if case == "no_grad_forward":  # a bootstrap target (DQN, actor-critic) between forward and backward
                    with torch.no_grad():
                        y = batch(step, rank)[1] + 0.1 * model(x.flip(0))
                loss = nn.functional.mse_loss(out, y)
                loss.backward()
        _same_grads(ours.module, theirs.module, step)  # local inside no_sync, averaged otherwise
        if not accumulate:
            for opt in opts:
                opt.step()
                opt.zero_grad()
    ours_state, theirs_state = ours.module.state_dict(), theirs.module.state_dict()
    assert list(ours_state) == list(theirs_state)
    for name in ours_state:
        torch.testing.assert_close(ours_state[name], theirs_state[name], msg=lambda m, n=name: f"{n}: {m}")
    first = next(ours.module.parameters()).detach().clone()
    spmd.broadcast(first, group_src=0)
    torch.testing.assert_close(first, next(ours.module.parameters()).detach())  # ranks agree
    return {"buckets": len(ours.reducer.buckets), "changed": not torch.equal(ours_state["fc1.weight"], base.state_dict()["fc1.weight"])}


def _same_grads(ours: nn.Module, theirs: nn.Module, step: int) -> None:
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        assert (p.grad is None) == (q.grad is None), f"step {step}: {name}.grad is {p.grad} here, {q.grad} in torch"
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m, n=name: f"step {step}: {n}.grad: {m}")


def mismatch() -> dict[str, Any]:
    """Rank 1's forward skips a parameter rank 0 uses, with find_unused_parameters=False."""
    torch.manual_seed(0)
    ddp = DDP(Net(extra=True))
    x, y = batch(0, spmd.get_rank())
    start = time.monotonic()
    try:
        loss = nn.functional.mse_loss(ddp(x, use_extra=spmd.get_rank() == 0), y)
        loss.backward()
        result = "no error"
    except spmd.SpmdError as error:
        result = f"{type(error).__name__}: {error}"
    elapsed = time.monotonic() - start
    check = torch.ones(1)
    spmd.all_reduce(check)  # the ranks are still in step: the next collective matches up
    return {"result": result, "elapsed": elapsed, "check": check.item()}


def custom_hook() -> dict[str, Any]:
    """A third-party hook registered by name sees the bucket API and reduces correctly."""
    seen: list[tuple[int, int, int]] = []
    first_layer_pending: list[bool] = []

    def counting_hook(state: Any, bucket: Any) -> spmd.Work:
        seen.append((bucket.index(), len(bucket.parameters()), bucket.buffer().numel()))
        first_layer_pending.append(model.fc1.weight.grad is None)  # backward still running
        state["calls"] += 1
        return comm_hooks.allreduce_hook(None, bucket)

    comm_hooks.register_hook("test_counting", counting_hook, override=True)
    assert "test_counting" in comm_hooks.hook_names()
    torch.manual_seed(spmd.get_rank())
    model = Net()
    reference = copy.deepcopy(model)
    ddp = DDP(model, bucket_cap_mb=0.002)
    state = {"calls": 0}
    ddp.register_comm_hook(state, "test_counting")
    x, y = batch(0, spmd.get_rank())
    nn.functional.mse_loss(ddp(x), y).backward()
    # The same average computed by hand from the all-reduced per-rank gradients.
    reference.load_state_dict(ddp.state_dict())
    nn.functional.mse_loss(reference(x), y).backward()
    for p, q in zip(ddp.module.parameters(), reference.parameters()):
        expected = q.grad.clone()
        spmd.all_reduce(expected, op=spmd.ReduceOp.AVG)
        torch.testing.assert_close(p.grad, expected)
    total = sum(p.numel() for p in model.parameters())
    return {"calls": state["calls"], "buckets": len(ddp.reducer.buckets), "numel": sum(s[2] for s in seen), "total": total,
            "indices": [s[0] for s in seen], "overlapped": first_layer_pending[0]}


def state_dict_round_trip() -> dict[str, Any]:
    """state_dict has the wrapped module's keys; load accepts them with or without ``module.``."""
    from spmd.parallel import get_strategy

    torch.manual_seed(0)
    model = Net(bn=True)
    ddp = get_strategy("ddp").apply(model)
    keys = list(ddp.state_dict())
    assert keys == list(model.state_dict()), keys
    changed = {k: v + 1 for k, v in model.state_dict().items()}
    ddp.load_state_dict(changed)
    torch.testing.assert_close(model.fc1.weight.detach(), changed["fc1.weight"])
    ddp.load_state_dict({f"module.{k}": v - 1 for k, v in changed.items()})
    nested = nn.Sequential(ddp)  # a wrapper inside another module round-trips too
    nested.load_state_dict(nested.state_dict())
    return {"keys": keys, "nested": list(nested.state_dict())[:2], "type": type(ddp).__name__}


def against_local_reference(members: list[int] | None = None, steps: int = 10) -> dict[str, Any] | None:
    """DDP over ``members`` (the world when None); ranks outside the group stay out.

    The reference trains a local copy on every member's batch at once (the mean
    of equal-size batch losses has the averaged gradient): no torch.distributed,
    so it runs on any backend.
    """
    group = spmd.new_group(members) if members is not None else None
    if group is spmd.GroupMember.NON_GROUP_MEMBER:
        return None
    members = spmd.get_process_group_ranks(group) if group is not None else list(range(spmd.get_world_size()))
    torch.manual_seed(7 + spmd.get_rank())
    ddp = DDP(Net(), process_group=group)
    reference = copy.deepcopy(ddp.module)  # after DDP's broadcast: group rank 0's weights
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ddp, reference)]
    for step in range(steps):
        x, y = batch(step, spmd.get_rank())
        nn.functional.mse_loss(ddp(x), y).backward()
        losses = [nn.functional.mse_loss(reference(bx), by) for bx, by in (batch(step, r) for r in members)]
        (sum(losses) / len(losses)).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for p, q in zip(ddp.module.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q)
    return {"group_rank": spmd.get_rank(group), "members": members, "backend": spmd.get_backend(group)}


def uneven(case: str) -> dict[str, Any]:
    """Rank r trains on 5 + 3r batches inside ``join()``: spmd DDP and torch DDP must end equal."""
    gloo = _torch_group()
    rank = spmd.get_rank()
    torch.manual_seed(100 + rank)
    base = Net(extra=case == "unused", bn=True)
    options: dict[str, Any] = {"find_unused_parameters": True} if case == "unused" else {}
    join_options: dict[str, Any] = {"divide_by_initial_world_size": case != "active_ranks"}
    steps = 3 * rank + (0 if case == "no_batches" else 5)  # "no_batches": rank 0 joins before any step
    states = []
    for wrap in (DDP, TorchDDP):
        model = wrap(copy.deepcopy(base), **options) if wrap is DDP else wrap(copy.deepcopy(base), process_group=gloo, **options)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        with model.join(**join_options):
            for step in range(steps):
                x, y = batch(step, rank)
                # Once rank 0 has joined, the last rank uses every parameter: torch's joined rank
                # reports its last iteration's usage, spmd's reports none (see DDP.join).
                use_extra = step >= 5 or _uses_extra(case, step, rank)
                nn.functional.mse_loss(model(x, use_extra=use_extra), y).backward()
                opt.step()
                opt.zero_grad()
        states.append(model.module.state_dict())
    ours, theirs = states
    assert list(ours) == list(theirs)
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], msg=lambda m, n=name: f"{n}: {m}")
    return {"changed": not torch.equal(ours["fc1.weight"], base.state_dict()["fc1.weight"]), "fc1": ours["fc1.weight"].sum().item()}


def uneven_throw() -> dict[str, Any]:
    """With throw_on_early_termination, every rank raises once rank 0's data ends."""
    rank = spmd.get_rank()
    model = DDP(Net())
    start = time.monotonic()
    steps_done = 0
    try:
        with model.join(throw_on_early_termination=True):
            for step in range(3 + 3 * rank):
                x, y = batch(step, rank)
                nn.functional.mse_loss(model(x), y).backward()
                steps_done += 1
        result = "no error"
    except spmd.SpmdError as error:
        result = str(error)
    return {"result": result, "steps": steps_done, "elapsed": time.monotonic() - start}


class Shuffled(nn.Module):
    """Registered a, b, c but used c, a, b: gradients become ready in an order the
    registration order does not predict (b first, then a, then c)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(torch.tanh(self.c(x)))))


def rebuild() -> dict[str, Any]:
    """Buckets are re-cut along the first backward's ready order, and training still matches torch."""
    gloo = _torch_group()
    rank = spmd.get_rank()
    torch.manual_seed(7 + rank)
    base = Shuffled()
    ours = DDP(copy.deepcopy(base), bucket_cap_mb=0.0005)  # 512 B: one parameter per bucket
    theirs = TorchDDP(copy.deepcopy(base), bucket_cap_mb=0.0005, process_group=gloo)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ours, theirs)]
    layouts = []
    for step in range(6):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
        for model in (ours, theirs):
            nn.functional.mse_loss(model(x), y).backward()
        _same_grads(ours.module, theirs.module, step)
        layouts.append([bucket.names for bucket in ours.reducer.buckets])
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return {"layouts": layouts}
