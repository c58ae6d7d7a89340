"""Single-process tests of the tensor half: placements, specs, the redistribution plan, rule propagation.

No processes and no world: meshes are ``DeviceMesh.for_planning`` (a grid and
one rank's place in it), DTensors are built from their local piece and spec,
and every op here needs no communication, so it runs on the local shards.
Results are compared with the same computation on whole tensors.
"""

from __future__ import annotations

import itertools
import types

import pytest
import torch

import spmd
from spmd import plugins
from spmd.errors import SpmdError
from spmd.mesh import DeviceMesh
from spmd.tensor import DTensor, Partial, Replicate, Shard, pointwise_rule, registry
from spmd.tensor.dispatch import Dispatcher, dispatcher
from spmd.tensor.errors import MixedTensorError
from spmd.tensor.placements import chunk_offset, chunk_sizes
from spmd.tensor.redistribute import plan
from spmd.tensor.spec import (
    DTensorSpec,
    contiguous_stride,
    local_piece,
    local_shape_and_offset,
    normalize_placements,
)

aten = torch.ops.aten


def mesh_2x2(rank: int) -> DeviceMesh:
    return DeviceMesh.for_planning([[0, 1], [2, 3]], rank)


def dtensor(full: torch.Tensor, mesh: DeviceMesh, placements: tuple) -> DTensor:
    """``full`` as the DTensor this mesh's rank holds (Partial: rank 0 of each partial dim holds it, the rest zeros)."""
    shape = tuple(full.shape)
    spec = DTensorSpec(mesh, placements, shape, contiguous_stride(shape), full.dtype)
    local = local_piece(full, spec).clone()
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    if any(isinstance(p, Partial) and coordinate[d] != 0 for d, p in enumerate(placements)):
        local.zero_()
    return DTensor(local, spec)


# -- placements and specs -------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 5, 8, 9])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_chunk_sizes_and_offsets_follow_torch_chunk(size, n):
    pieces = torch.arange(size).chunk(n) if size else ()
    expected = [len(p) for p in pieces] + [0] * (n - len(pieces))
    assert chunk_sizes(size, n) == expected
    assert [chunk_offset(size, n, k) for k in range(n)] == [sum(expected[:k]) for k in range(n)]


def test_placements_compare_hash_and_describe_themselves():
    assert Shard(1) == Shard(1) and Shard(1) != Shard(0) and Replicate() == Replicate()
    assert Partial() == Partial("sum") != Partial("max")
    assert len({Shard(0), Shard(0), Replicate(), Partial()}) == 3
    assert Shard(0).is_shard() and Shard(2).is_shard(2) and not Shard(2).is_shard(1) and not Replicate().is_shard()


@pytest.mark.parametrize("placements", [(Shard(0), Shard(0)), (Shard(1), Shard(0)), (Replicate(), Shard(1)), (Shard(0), Replicate())])
def test_local_shape_and_offset_is_where_the_piece_lies(placements):
    """Nested sharding chunks mesh dim 1 inside mesh dim 0's piece: shapes and offsets agree with torch.chunk."""
    full = torch.arange(7 * 5).reshape(7, 5)
    for rank in range(4):
        mesh = mesh_2x2(rank)
        shape, offset = local_shape_and_offset((7, 5), mesh, placements)
        piece = full
        for mesh_dim, p in enumerate(placements):
            if isinstance(p, Shard):
                chunks = list(piece.chunk(2, p.dim)) + [piece.narrow(p.dim, 0, 0)] * 2
                piece = chunks[mesh.get_coordinate()[mesh_dim]]
        assert shape == tuple(piece.shape)
        if piece.numel():
            assert full[offset] == piece.flatten()[0]


def test_normalize_placements_resolves_negative_dims_and_names_mistakes():
    mesh = mesh_2x2(0)
    assert normalize_placements([Shard(-1), Replicate()], mesh, 3) == (Shard(2), Replicate())
    with pytest.raises(ValueError, match="2-D mesh"):
        normalize_placements([Shard(0)], mesh, 2)
    with pytest.raises(ValueError, match="out of range"):
        normalize_placements([Shard(3), Replicate()], mesh, 2)
    with pytest.raises(TypeError, match="placements must be"):
        normalize_placements([0, Replicate()], mesh, 2)


def test_a_planning_mesh_has_a_shape_but_no_groups():
    mesh = mesh_2x2(3)
    assert mesh.shape == (2, 2) and mesh.get_coordinate() == [1, 1] and mesh.size() == 4 and mesh.size(1) == 2
    assert mesh != mesh_2x2(2)  # another rank's view plans other local shapes
    with pytest.raises(SpmdError, match="has no groups"):
        mesh.get_group(0)


# -- the redistribution plan ------------------------------------------------------------------------------

PLACEMENTS = [Replicate(), Shard(0), Shard(1), Partial()]


@pytest.mark.parametrize("src", list(itertools.product(PLACEMENTS, repeat=2)), ids=str)
def test_plan_reaches_the_target_in_legal_phases(src):
    """Every step starts where the previous left the mesh dim; unsharding and partial sums resolve before new
    shards are cut; only Replicate turns into Partial; the last step leaves every dim at the target."""
    for dst in itertools.product([Replicate(), Shard(0), Shard(1), Partial()], repeat=2):
        current = list(src)
        cutting = False
        for mesh_dim, before, after in plan(src, dst):
            assert current[mesh_dim] == before != after
            if isinstance(before, Replicate):
                cutting = True  # phase 3: local slices only, nothing gathered or reduced after it
            else:
                assert not cutting, (src, dst, plan(src, dst))
            if isinstance(after, Partial):
                assert isinstance(before, Replicate)
            current[mesh_dim] = after
        assert tuple(current) == dst


def test_plan_undoes_inner_shards_first_and_uses_all_to_all_where_it_can():
    assert plan((Shard(0), Shard(0)), (Replicate(), Replicate())) == ((1, Shard(0), Replicate()), (0, Shard(0), Replicate()))
    assert plan((Shard(0),), (Shard(1),)) == ((0, Shard(0), Shard(1)),)  # one all-to-all
    assert plan((Partial(),), (Shard(0),)) == ((0, Partial(), Shard(0)),)  # one reduce-scatter
    assert plan((Replicate(), Shard(1)), (Replicate(), Shard(1))) == ()


# -- rule propagation on a planning mesh ---------------------------------------------------------------------


def test_pointwise_keeps_shards_and_computes_locally():
    a, b = torch.randn(6, 4), torch.randn(6, 4)
    for rank in range(4):
        mesh = mesh_2x2(rank)
        x, y = dtensor(a, mesh, (Shard(0), Shard(1))), dtensor(b, mesh, (Shard(0), Shard(1)))
        planned = Dispatcher().plan(aten.mul.Tensor, (x, y))
        assert planned is not None and planned.direct
        assert planned.out_specs[0].placements == (Shard(0), Shard(1))
        out = torch.mul(x, y)
        assert out.placements == (Shard(0), Shard(1))
        assert torch.equal(out._local_tensor, local_piece(a * b, out._spec))


def test_pointwise_broadcasts_a_shard_onto_the_other_operand():
    mesh = mesh_2x2(1)
    x = dtensor(torch.randn(6, 4), mesh, (Replicate(), Shard(1)))
    bias = dtensor(torch.randn(4), mesh, (Replicate(), Replicate()))
    planned = Dispatcher().plan(aten.add.Tensor, (x, bias))
    assert planned is not None
    assert planned.targets == ((Replicate(), Shard(1)), (Replicate(), Shard(0)))  # the bias is cut to match
    assert planned.out_specs[0].placements == (Replicate(), Shard(1)) and not planned.direct


def test_matmul_row_shard_and_contraction_shard():
    mesh = DeviceMesh.for_planning([0, 1], 1)
    a, w = torch.randn(6, 4), torch.randn(4, 3)
    rows = Dispatcher().plan(aten.mm.default, (dtensor(a, mesh, (Shard(0),)), dtensor(w, mesh, (Replicate(),))))
    assert rows is not None and rows.direct and rows.out_specs[0].placements == (Shard(0),)
    inner = Dispatcher().plan(aten.mm.default, (dtensor(a, mesh, (Shard(1),)), dtensor(w, mesh, (Shard(0),))))
    assert inner is not None and inner.out_specs[0].placements == (Partial(),)
    # each rank's local product is its summand: the two ranks' summands add up to the whole product
    summands = []
    for rank in range(2):
        m = DeviceMesh.for_planning([0, 1], rank)
        summands.append(torch.mm(dtensor(a, m, (Shard(1),)), dtensor(w, m, (Shard(0),)))._local_tensor)
    torch.testing.assert_close(summands[0] + summands[1], a @ w)


def test_reduction_over_a_sharded_dim_is_partial_and_over_another_keeps_the_shard():
    mesh = DeviceMesh.for_planning([0, 1], 0)
    x = dtensor(torch.randn(6, 4), mesh, (Shard(0),))
    over_shard = Dispatcher().plan(aten.sum.dim_IntList, (x, [0]))
    assert over_shard is not None and over_shard.out_specs[0].placements == (Partial(),)
    over_other = Dispatcher().plan(aten.sum.dim_IntList, (x, [1]))
    assert over_other is not None and over_other.out_specs[0].placements == (Shard(0),)


def test_a_view_rewrites_its_size_to_the_local_shard():
    full = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    for rank in range(2):
        mesh = DeviceMesh.for_planning([0, 1], rank)
        x = dtensor(full, mesh, (Shard(0),))
        out = x.view(8, 2, 3)
        assert out.shape == (8, 2, 3) and out.placements == (Shard(0),)
        assert torch.equal(out._local_tensor, local_piece(full.view(8, 2, 3), out._spec))
        planned = dispatcher.plan(aten.view.default, (x, [8, 2, 3]))
        assert planned is not None and planned.info is not None and planned.info.out_shapes == ((4, 2, 3),)


def test_a_plain_tensor_beside_dtensors_is_refused_unless_implicitly_replicated():
    mesh = DeviceMesh.for_planning([0, 1], 1)
    full, mask = torch.randn(4, 3), torch.randn(4, 3)
    x = dtensor(full, mesh, (Replicate(),))
    with pytest.raises(MixedTensorError, match="implicit_replication"):
        torch.add(x, mask)
    with dispatcher.implicit_replication():
        out = torch.add(x, mask)
    assert out.placements == (Replicate(),) and torch.equal(out._local_tensor, full + mask)
    assert dispatcher.implicit_depth == 0


def test_an_overriding_context_takes_the_op_over_and_restores_it():
    mesh = DeviceMesh.for_planning([0, 1], 0)
    x = dtensor(torch.randn(4), mesh, (Shard(0),))
    calls = []

    def neg(t: DTensor) -> DTensor:
        calls.append(t)
        return dispatcher.dispatch_by_rule(aten.neg.default, (t,), {})

    with dispatcher.overriding({aten.neg.default: neg}):
        inside = torch.neg(x)
    outside = torch.neg(x)
    assert calls == [x] and torch.equal(inside._local_tensor, outside._local_tensor)
    assert aten.neg.default not in dispatcher.overrides


# -- a rule registered at run time ----------------------------------------------------------------------------

try:
    @torch.library.custom_op("spmd_units::twice", mutates_args=())
    def twice(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @twice.register_fake
    def _(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)
except RuntimeError:  # (registered already: the module imported twice in one process)
    pass
TWICE = torch.ops.spmd_units.twice.default


def test_a_rule_registered_at_run_time_replaces_the_planned_fallback():
    """The plan cache follows the plugin generation: an op planned without a rule (the fallback, gathered)
    gets a rule plugin's plan from the next call on, and loses it with the plugin."""
    mesh = DeviceMesh.for_planning([0, 1], 1)
    full = torch.randn(6, 2)
    x = dtensor(full, mesh, (Shard(0),))
    assert registry.lookup(TWICE) is None
    with pytest.warns(UserWarning, match="no sharding rule"):
        before = dispatcher.plan(TWICE, (x,))
    assert before is not None and before.fallback and before.targets == ((Replicate(),),)

    plugin = types.ModuleType("spmd_units_rules")
    plugin.spmd_sharding_rules = spmd.hookimpl(lambda: {TWICE: pointwise_rule})  # type: ignore[attr-defined]
    plugins.manager().register(plugin, name="spmd-units-rules")
    try:
        after = dispatcher.plan(TWICE, (x,))
        assert after is not None and not after.fallback and after.direct
        out = TWICE(x)  # no gather: computed on the shard
        assert out.placements == (Shard(0),) and torch.equal(out._local_tensor, local_piece(full * 2, out._spec))
        assert registry.owner(TWICE) == "spmd-units-rules"
    finally:
        plugins.manager().unregister(name="spmd-units-rules")
    again = dispatcher.plan(TWICE, (x,))
    assert again is not None and again.fallback
