"""Rank functions for test_mesh.py and test_dtensor.py (pickled by reference, run on every rank)."""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import torch
import torch.nn.functional as F

import spmd
from spmd import Partial, Replicate, Shard
from spmd.tensor import CommDebugMode, DTensor
from spmd.testing.rules import check_sharding


def _error(fn: Any) -> str:
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - the error is the result
        return f"{type(error).__name__}: {error}"
    return "no error"


# -- mesh ------------------------------------------------------------------------------------------


def mesh_facts() -> dict[str, Any]:
    """A (2, 2) mesh: coordinates, sub-meshes, groups and errors."""
    mesh = spmd.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp, dp = mesh["tp"], mesh["dp"]
    both = mesh["tp", "dp"]
    t = torch.tensor([float(spmd.get_rank())])
    spmd.all_reduce(t, group=tp.get_group())
    return {
        "coordinate": mesh.get_coordinate(),
        "local": (mesh.get_local_rank("dp"), mesh.get_local_rank("tp")),
        "shape": mesh.shape,
        "size": (mesh.size(), mesh.size("tp")),
        "tp_ranks": list(mesh.get_group("tp").ranks),
        "dp_ranks": list(dp.get_group().ranks),
        "same_group": tp.get_group() is mesh.get_group("tp"),
        "swapped": both.mesh.tolist(),
        "tp_sum": t.item(),
        "errors": {
            "product": _error(lambda: spmd.init_device_mesh("cpu", (3, 2))),
            "duplicate": _error(lambda: spmd.init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "a"))),
            "count": _error(lambda: spmd.init_device_mesh("cpu", (2, 2), mesh_dim_names=("a",))),
            "unknown": _error(lambda: mesh["pp"]),
            "outside": _error(lambda: spmd.DeviceMesh("cpu", [0, 1, 7])),
            "repeat": _error(lambda: spmd.DeviceMesh("cpu", [0, 0, 1, 2])),
        },
    }


def per_dimension_backend() -> dict[str, Any]:
    """backend= per dimension: dp over gloo, tp over the isend/irecv-only example plugin."""
    mesh = spmd.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"), backend={"dp": "gloo", "tp": "p2p"})
    x = torch.arange(16.0).reshape(4, 4)
    dt = spmd.distribute_tensor(x, mesh, [Shard(0), Shard(1)])
    full = dt.full_tensor()
    # torch's spelling: dimension index -> (backend, options)
    torch_style = spmd.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"), backend_override={1: ("p2p", None)})
    return {
        "tp": spmd.get_backend(mesh.get_group("tp")),
        "dp": spmd.get_backend(mesh.get_group("dp")),
        "equal": torch.equal(full, x),
        "override_tp": spmd.get_backend(torch_style.get_group("tp")),
    }


# -- redistribution ----------------------------------------------------------------------------------


def _placements(ndim: int, mesh_ndim: int) -> list[tuple]:
    single = [Replicate(), Partial(), *[Shard(d) for d in range(ndim)]]
    return list(itertools.product(single, repeat=mesh_ndim))


def all_transitions(shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> list[str]:
    """Every (src, dst) pair of placements: values and gradients (the adjoint) against the full tensor."""
    mesh = spmd.init_device_mesh("cpu", mesh_shape)
    torch.manual_seed(0)
    x = torch.randn(shape)
    w = torch.randn(shape)
    bad = []
    options = _placements(len(shape), len(mesh_shape))
    for src in options:
        for dst in options:
            dt = spmd.distribute_tensor(x, mesh, list(src)).requires_grad_()
            out = dt.redistribute(mesh, list(dst))
            if tuple(out.placements) != dst:
                bad.append(f"{src}->{dst}: placements {out.placements}")
            expected_local = spmd.distribute_tensor(x, mesh, list(dst))._local_tensor.shape
            if out.to_local().shape != expected_local:
                bad.append(f"{src}->{dst}: local shape {tuple(out.to_local().shape)} != {tuple(expected_local)}")
            if not torch.allclose(out.full_tensor(), x, atol=1e-5):
                bad.append(f"{src}->{dst}: value")
                continue
            (out.full_tensor() * w).sum().backward()
            grad = dt.grad
            if not torch.allclose(grad.full_tensor(), w, atol=1e-5):
                bad.append(f"{src}->{dst}: gradient")
            if any(isinstance(p, Partial) for p in grad.placements):
                bad.append(f"{src}->{dst}: gradient left partial {grad.placements}")
    return bad


def uneven_shards() -> dict[str, Any]:
    """7 rows over 4 ranks: 2, 2, 2, 1; 3 rows: 1, 1, 1, 0 (an empty shard), from_local with shape=."""
    mesh = spmd.init_device_mesh("cpu", (4,))
    x = torch.arange(14.0).reshape(7, 2)
    seven = spmd.distribute_tensor(x, mesh, [Shard(0)])
    three = spmd.distribute_tensor(torch.ones(3, 2), mesh, [Shard(0)])
    rank = spmd.get_rank()
    rebuilt = DTensor.from_local(seven.to_local().clone(), mesh, [Shard(0)], shape=(7, 2))
    doubled = (rebuilt * 2).full_tensor()
    mismatch = _error(lambda: DTensor.from_local(torch.ones(3, 2), mesh, [Shard(0)], shape=(7, 2)))
    return {
        "rows": seven.to_local().shape[0],
        "three": three.to_local().shape[0],
        "values": seven.to_local().tolist(),
        "expected": x.chunk(4)[rank].tolist() if rank < len(x.chunk(4)) else [],
        "doubled": torch.equal(doubled, x * 2),
        "three_full": torch.equal(three.full_tensor(), torch.ones(3, 2)),
        "mismatch": mismatch,
    }


def local_roundtrip_gradients() -> dict[str, Any]:
    """from_local and to_local pass gradients through; Partial from_local sums the ranks' tensors."""
    mesh = spmd.init_device_mesh("cpu", (spmd.get_world_size(),))
    rank = spmd.get_rank()
    local = torch.full((2, 3), float(rank + 1), requires_grad=True)
    dt = DTensor.from_local(local, mesh, [Shard(0)])
    (dt * 3).to_local().sum().backward()
    partial = DTensor.from_local(torch.full((2,), float(rank + 1)), mesh, [Partial()])
    src = torch.ones(2, 3, requires_grad=True)
    rep = spmd.distribute_tensor(src.detach(), mesh, [Replicate()]).requires_grad_()
    rep.redistribute(mesh, [Partial()]).full_tensor().sum().backward()
    return {
        "grad": local.grad.tolist(),
        "shape": tuple(dt.shape),
        "partial_sum": partial.full_tensor().tolist(),
        "replicate_grad": rep.grad.full_tensor().tolist(),
    }


def distribute_takes_rank0_data() -> bool:
    mesh = spmd.init_device_mesh("cpu", (spmd.get_world_size(),))
    x = torch.full((4,), float(spmd.get_rank()))
    return spmd.distribute_tensor(x, mesh, [Shard(0)]).full_tensor().tolist()


# -- rules ---------------------------------------------------------------------------------------------


def _cases() -> dict[str, tuple]:
    g = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    idx = torch.randint(0, 6, (5,), generator=g)
    return {
        "add": (torch.add, r(5, 3), r(5, 3)),
        "sub_broadcast": (torch.sub, r(5, 3), r(3)),
        "mul": (torch.mul, r(5, 3), r(5, 3)),
        "div_scalar": (lambda x: x / 3.0, r(5, 3)),
        "div_floor": (lambda x: torch.div(x, 0.7, rounding_mode="floor"), r(5, 3)),  # not linear
        "div_into_scalar": (lambda x: torch.div(torch.tensor(2.0), x), r(5, 3).abs() + 1),  # partial denominator
        "to_int": (lambda x: x.to(torch.int64), r(5, 3) * 3),  # truncation is not linear
        "gelu": (F.gelu, r(5, 3)),
        "relu_inplace": (lambda x: x.clone().relu_(), r(5, 3)),
        "add_inplace": (lambda x, y: x.clone().add_(y), r(5, 3), r(5, 3)),
        "where": (lambda x, y: torch.where(x > 0, x, y), r(5, 3), r(5, 3)),
        "mm": (torch.mm, r(5, 4), r(4, 3)),
        "addmm": (torch.addmm, r(3), r(5, 4), r(4, 3)),
        "bmm": (torch.bmm, r(2, 3, 4), r(2, 4, 5)),
        "baddbmm": (torch.baddbmm, r(2, 3, 5), r(2, 3, 4), r(2, 4, 5)),
        "linear_3d": (F.linear, r(2, 5, 4), r(3, 4), r(3)),
        "matmul": (torch.matmul, r(2, 5, 4), r(4, 3)),
        "sum_all": (torch.sum, r(5, 3)),
        "sum_dim": (lambda x: x.sum(1), r(5, 3)),
        "mean_keepdim": (lambda x: x.mean(0, keepdim=True), r(4, 3)),
        "mean_uneven": (lambda x: x.mean(0), r(5, 3)),
        "amax": (lambda x: x.amax(-1), r(5, 3)),
        "var": (lambda x: x.var(0), r(5, 3)),
        "softmax": (lambda x: F.softmax(x, -1), r(5, 3)),
        "log_softmax": (lambda x: F.log_softmax(x, 0), r(5, 3)),
        "layer_norm": (lambda x, w, b: F.layer_norm(x, (3,), w, b), r(2, 5, 3), r(3), r(3)),
        "rms_norm": (lambda x, w: F.rms_norm(x, (3,), w), r(5, 3), r(3)),
        "embedding": (lambda i, w: F.embedding(i, w), idx, r(6, 4)),
        "cross_entropy": (lambda x, t: F.cross_entropy(x, t), r(5, 6), idx),
        "cross_entropy_sum": (lambda x, t: F.cross_entropy(x, t, reduction="sum"), r(5, 6), idx),
        "dropout_eval": (lambda x: F.dropout(x, 0.5, training=False), r(5, 3)),
        "view_merge": (lambda x: x.view(8, 3), r(2, 4, 3)),
        "view_split": (lambda x: x.view(2, 4, 3), r(8, 3)),
        "reshape": (lambda x: x.reshape(3, 8), r(2, 4, 3)),
        "flatten": (lambda x: x.flatten(1), r(2, 3, 2)),
        "transpose": (lambda x: x.transpose(0, 1), r(5, 3)),
        "permute": (lambda x: x.permute(2, 0, 1), r(2, 3, 4)),
        "expand": (lambda x: x.expand(4, 5, 3), r(5, 3)),
        "unsqueeze": (lambda x: x.unsqueeze(1), r(5, 3)),
        "squeeze": (lambda x: x.squeeze(1), r(5, 1, 3)),
        "squeeze_all": (lambda x: x.squeeze(), r(2, 1)),  # shards of local size 1 along a longer dimension stay
        "squeeze_dim0": (lambda x: x.squeeze(0), r(4, 3)),
        "split": (lambda x: x.split([1, 2], 1), r(5, 3)),
        "chunk": (lambda x: x.chunk(2, 0), r(5, 3)),
        "cat": (lambda a, b: torch.cat([a, b], 1), r(5, 3), r(5, 2)),
        "stack": (lambda a, b: torch.stack([a, b], 1), r(5, 3), r(5, 3)),
        "slice": (lambda x: x[1:4], r(5, 3)),
        "select": (lambda x: x[:, 1], r(5, 3)),
        "index_select": (lambda x, i: x.index_select(0, i), r(6, 3), idx),
        "zeros_like": (lambda x: torch.zeros_like(x) + x, r(5, 3)),
        "ones_like": (lambda x: torch.ones_like(x) * x, r(5, 3)),
        "copy": (lambda x, y: x.clone().copy_(y), r(5, 3), r(5, 3)),
        "copy_broadcast": (lambda x, y: x.clone().copy_(y), r(4, 3), r(3)),
        "sdpa": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), r(2, 2, 4, 3), r(2, 2, 4, 3), r(2, 2, 4, 3)),
    }


def rule_conformance(names: list[str], max_combinations: int) -> dict[str, str]:
    """Run the conformance kit on the named cases; the result maps each failing case to its report."""
    cases = _cases()
    failures = {}
    for name in names:
        fn, *args = cases[name]
        try:
            check_sharding(fn, *args, max_combinations=max_combinations)
        except AssertionError as error:
            failures[name] = str(error)[:1500]
    return failures


def case_names() -> list[str]:
    return list(_cases())


def foreach_adamw_step() -> dict[str, Any]:
    """torch.optim.AdamW with foreach=True and foreach=False on DTensor parameters against plain tensors."""
    mesh = spmd.init_device_mesh("cpu", (spmd.get_world_size(),))
    torch.manual_seed(0)
    results = {}
    for foreach in (True, False):
        plain = [torch.randn(5, 3, requires_grad=True), torch.randn(3, requires_grad=True)]
        dist = [spmd.distribute_tensor(p.detach(), mesh, [Shard(0)]).requires_grad_() for p in plain]
        opt_p = torch.optim.AdamW(plain, lr=0.1, foreach=foreach)
        opt_d = torch.optim.AdamW(dist, lr=0.1, foreach=foreach)
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            grads = [torch.randn(p.shape, generator=g) for p in plain]
            for p, d, grad in zip(plain, dist, grads):
                p.grad = grad.clone()
                d.grad = spmd.distribute_tensor(grad, mesh, [Shard(0)])
            opt_p.step()
            opt_d.step()
        results[str(foreach)] = all(torch.allclose(d.full_tensor(), p.detach(), atol=1e-6) for p, d in zip(plain, dist))
    return results


def in_place_keeps_placement() -> dict[str, Any]:
    """An in-place op writes into its tensor's placement: a replicated parameter stepped with a
    partial gradient stays replicated (the gradient is reduced), with a single-process check."""
    mesh = spmd.init_device_mesh("cpu", (spmd.get_world_size(),))
    rank, world = spmd.get_rank(), spmd.get_world_size()
    torch.manual_seed(0)
    plain = torch.randn(6)
    parts = [torch.randn(6, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    param = spmd.distribute_tensor(plain.clone(), mesh, [Replicate()])
    grad = spmd.DTensor.from_local(parts[rank], mesh, [Partial()])
    param.add_(grad, alpha=-0.5)
    sharded = spmd.distribute_tensor(plain.clone(), mesh, [Shard(0)])
    sharded.mul_(spmd.distribute_tensor(torch.full((6,), 2.0), mesh, [Replicate()]))
    return {
        "placements": [str(p) for p in param.placements],
        "values": torch.allclose(param.to_local(), plain - 0.5 * sum(parts), atol=1e-6),
        "sharded": [str(p) for p in sharded.placements],
        "sharded_values": torch.allclose(sharded.full_tensor(), plain * 2, atol=1e-6),
    }


def fallback_warns_once() -> dict[str, Any]:
    """An op without a rule (cumsum) is computed correctly, with one warning naming it."""
    mesh = spmd.init_device_mesh("cpu", (spmd.get_world_size(),))
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    dt = spmd.distribute_tensor(x, mesh, [Shard(0)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = torch.cumsum(dt, 0)
        torch.cumsum(dt, 0)
    messages = [str(w.message) for w in caught if "no sharding rule" in str(w.message)]
    return {
        "equal": torch.allclose(first.full_tensor(), torch.cumsum(x, 0), atol=1e-6),
        "placements": list(first.placements) == [Shard(0)],
        "messages": messages,
    }


def mixed_plain_tensor_error() -> str:
    mesh = spmd.init_device_mesh("cpu", (spmd.get_world_size(),))
    dt = spmd.distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])
    return _error(lambda: dt + torch.ones(4, 2))


def comm_counts_mlp() -> dict[str, Any]:
    """Column- then row-parallel MLP: forward needs exactly one all-reduce (the partial output)."""
    mesh = spmd.init_device_mesh("cpu", (spmd.get_world_size(),))
    torch.manual_seed(0)
    fc1 = torch.nn.Linear(8, 16)
    fc2 = torch.nn.Linear(16, 8)
    w1 = spmd.distribute_tensor(fc1.weight.detach(), mesh, [Shard(0)]).requires_grad_()
    b1 = spmd.distribute_tensor(fc1.bias.detach(), mesh, [Shard(0)]).requires_grad_()
    w2 = spmd.distribute_tensor(fc2.weight.detach(), mesh, [Shard(1)]).requires_grad_()
    b2 = spmd.distribute_tensor(fc2.bias.detach(), mesh, [Replicate()]).requires_grad_()
    x = spmd.distribute_tensor(torch.randn(4, 8), mesh, [Replicate()])
    with CommDebugMode() as forward:
        out = F.linear(F.relu(F.linear(x, w1, b1)), w2, b2)
        full = out.redistribute(mesh, [Replicate()])
    with CommDebugMode() as backward:
        full.sum().backward()
    return {
        "forward": forward.get_comm_counts(),
        "backward": backward.get_comm_counts(),
        "out_placements": [str(p) for p in out.placements],
        "bytes": forward.get_comm_bytes(),
    }


def custom_op_rule_from_plugin() -> dict[str, Any]:
    """A torch.library op whose rule comes from the installed example plugin spmd-example-rules."""
    import spmd_example_rules  # noqa: F401 - registers the op (the plugin's import does too)

    from spmd.tensor import registry

    mesh = spmd.init_device_mesh("cpu", (spmd.get_world_size(),))
    op = torch.ops.spmd_example.scaled_gelu.default
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    dt = spmd.distribute_tensor(x, mesh, [Shard(0)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = op(dt, 2.0)
    check_sharding(op, x, 2.0, grad=False)
    return {
        "owner": registry.owner(op),
        "placements": [str(p) for p in out.placements],
        "equal": torch.allclose(out.full_tensor(), op(x, 2.0)),
        "fallback_warnings": [str(w.message) for w in caught if "no sharding rule" in str(w.message)],
    }


_KIT_LIBRARY: list[Any] = []  # the test op's torch.library, defined once per worker process


def kit_verdicts() -> dict[str, Any]:
    """The conformance kit on a wrong rule (cumsum along dim 0 declared pointwise) and on inputs
    that differ per rank (the kit must use rank 0's, as its docstring says)."""
    import types

    from spmd.plugins import manager
    from spmd.tensor import pointwise_rule

    if not _KIT_LIBRARY:
        lib = torch.library.Library("spmd_kit_test", "DEF")
        lib.define("cumsum0(Tensor x) -> Tensor")
        lib.impl("cumsum0", lambda x: torch.cumsum(x, 0), "CPU")
        torch.library.register_fake("spmd_kit_test::cumsum0", lambda x: torch.empty_like(x), lib=lib)
        plugin = types.ModuleType("spmd_kit_test_rules")
        plugin.spmd_sharding_rules = spmd.hookimpl(lambda: {torch.ops.spmd_kit_test.cumsum0.default: pointwise_rule})  # type: ignore[attr-defined]
        manager().register(plugin, name="kit-test-rules")
        _KIT_LIBRARY.append(lib)
    out: dict[str, Any] = {}
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    try:
        check_sharding(torch.ops.spmd_kit_test.cumsum0.default, x, grad=False)
        out["wrong_rule"] = "passed"
    except AssertionError as error:
        out["wrong_rule"] = str(error)
    differing = torch.randn(6, 4) + spmd.get_rank()  # unseeded, and offset: never equal across ranks
    try:
        out["differing_inputs"] = check_sharding(lambda a: a * 2 + 1, differing)
    except AssertionError as error:
        out["differing_inputs"] = str(error)
    return out


def redistributed_tensors_own_their_data() -> dict[str, Any]:
    """An in-place op on a redistributed tensor leaves its source alone; uneven from_local shards fail run_check."""
    mesh = spmd.init_device_mesh("cpu", (spmd.get_world_size(),))
    x = spmd.distribute_tensor(torch.ones(4, 2), mesh, [Replicate()])
    out: dict[str, Any] = {}
    for p in (Shard(0), Partial()):
        y = x.redistribute(mesh, [p])
        y.mul_(0)
        out[str(p)] = bool(x.to_local().eq(1).all())  # still replicated: the same ones on every rank
    local = torch.ones(4 - spmd.get_rank(), 3)  # 4 rows on rank 0, 3 on rank 1: each rank derives another global shape
    try:
        DTensor.from_local(local, mesh, [Shard(0)], run_check=True)
        out["uneven"] = "no error"
    except ValueError as error:
        out["uneven"] = str(error)
    return out


def rules_registered_and_removed_at_run_time() -> list[str]:
    """An op dispatched without a rule (the fallback keeps the shard), then with a rule a plugin registers at
    run time (replicate: a replicated result), then after that plugin is unregistered: each dispatch
    uses the rules in force at its time (the rule memo and plan caches follow ``plugins.generation``)."""
    import types
    import warnings

    from spmd.plugins import manager
    from spmd.tensor.rule import replicate_rule

    if not _LATE_LIBRARY:
        lib = torch.library.Library("spmd_late_rule", "DEF")
        lib.define("double(Tensor x) -> Tensor")
        lib.impl("double", lambda x: x * 2, "CPU")
        torch.library.register_fake("spmd_late_rule::double", lambda x: torch.empty_like(x), lib=lib)
        _LATE_LIBRARY.append(lib)
    op = torch.ops.spmd_late_rule.double.default
    mesh = spmd.init_device_mesh("cpu", (spmd.get_world_size(),))
    x = spmd.distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
    seen = []
    plugin = types.ModuleType("spmd_late_rules")
    plugin.spmd_sharding_rules = spmd.hookimpl(lambda: {op: replicate_rule})  # type: ignore[attr-defined]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the fallback's once-per-op warning)
        for step in ("before", "registered", "unregistered"):
            if step == "registered":
                manager().register(plugin, name="late-rules")
            elif step == "unregistered":
                manager().unregister(plugin)
            y = op(x)
            assert torch.equal(y.full_tensor(), torch.arange(8.0).reshape(4, 2) * 2)
            seen.append(f"{step}: {y.placements}")
    return seen


_LATE_LIBRARY: list[Any] = []


def builtin_rule_overridden_by_a_plugin() -> list[str]:
    """``x @ w`` (Shard(0) by Replicate) under the builtin mm rule (a row-sharded result), then under a plugin that
    maps aten.mm to ``spmd.Overriding(replicate_rule)`` (a replicated result), then with that plugin gone."""
    import types

    from spmd.plugins import manager
    from spmd.tensor.rule import replicate_rule

    mesh = spmd.init_device_mesh("cpu", (spmd.get_world_size(),))
    x, w = torch.arange(8.0).reshape(4, 2), torch.arange(6.0).reshape(2, 3)
    dx, dw = spmd.distribute_tensor(x, mesh, [Shard(0)]), spmd.distribute_tensor(w, mesh, [Replicate()])
    plugin = types.ModuleType("spmd_mm_override")
    plugin.spmd_sharding_rules = spmd.hookimpl(lambda: {torch.ops.aten.mm.default: spmd.Overriding(replicate_rule)})  # type: ignore[attr-defined]
    seen = []
    for step in ("builtin", "overridden", "plugin removed"):
        if step == "overridden":
            manager().register(plugin, name="mm-override")
        elif step == "plugin removed":
            manager().unregister(plugin)
        y = torch.mm(dx, dw)
        assert torch.equal(y.full_tensor(), x @ w)
        seen.append(f"{step}: {y.placements}")
    return seen


def meshes_made_without_a_mesh() -> dict[str, bool]:
    """distribute_tensor, DTensor.from_local, distribute_module and fully_shard without a mesh: one default mesh
    per world (each call made a new mesh, with new groups, before)."""
    from torch import nn

    from spmd.fsdp import fully_shard
    from spmd.tensor import distribute_module

    a = spmd.distribute_tensor(torch.ones(4, 2), placements=[Shard(0)])
    b = spmd.distribute_tensor(torch.ones(4, 2), placements=[Replicate()])
    c = DTensor.from_local(torch.ones(2, 2), placements=[Shard(0)])
    module = distribute_module(nn.Linear(2, 2))
    sharded = fully_shard(nn.Linear(4, 4))
    return {
        "tensors": a.device_mesh is b.device_mesh is c.device_mesh,
        "module": module.weight.device_mesh is a.device_mesh,
        "fsdp": sharded.weight.device_mesh is a.device_mesh,
    }
