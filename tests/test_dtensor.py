"""DTensor on real ranks: every redistribution (values and gradients), uneven shards, the rule
conformance kit for every builtin rule, optimizers, the fallback, CommDebugMode, a third-party rule."""

from __future__ import annotations

import dtensor_helpers as h
import pytest


@pytest.mark.parametrize(
    ("world", "shape", "mesh"),
    [(1, (3, 2), (1,)), (2, (5, 3), (2,)), (4, (7, 2), (4,)), (4, (5, 3), (2, 2))],
    ids=["1-rank", "2-ranks", "4-ranks-uneven", "2x2-mesh"],
)
def test_every_redistribution_and_its_gradient(spmd_world, world, shape, mesh):
    results = spmd_world(world, "gloo").run(h.all_transitions, shape, mesh, timeout=600)
    for rank, bad in enumerate(results):
        assert bad == [], f"rank {rank}: {bad[:10]}"


def test_uneven_and_empty_shards(spmd_world):
    for rank, r in enumerate(spmd_world(4, "gloo").run(h.uneven_shards, timeout=120)):
        assert r["rows"] == [2, 2, 2, 1][rank]
        assert r["three"] == [1, 1, 1, 0][rank]
        assert r["values"] == r["expected"]
        assert r["doubled"] and r["three_full"]
        assert "pass shape= for uneven shards" in r["mismatch"]


def test_from_local_to_local_and_partial_gradients(spmd_world):
    for _rank, r in enumerate(spmd_world(2, "gloo").run(h.local_roundtrip_gradients, timeout=120)):
        assert r["grad"] == [[3.0] * 3] * 2  # to_local(dt * 3) -> from_local: the gradient passes through
        assert r["shape"] == (4, 3)
        assert r["partial_sum"] == [3.0, 3.0]  # 1 + 2
        assert r["replicate_grad"] == [[1.0] * 3] * 2  # Replicate -> Partial: the whole gradient, not 1/N


def test_distribute_tensor_takes_rank_zero_data(spmd_world):
    for r in spmd_world(2, "gloo").run(h.distribute_takes_rank0_data, timeout=60):
        assert r == [0.0] * 4


CASES = h.case_names()


@pytest.mark.parametrize("world", [2, 4], ids=["1d-mesh", "1d-and-2d-mesh"])
def test_rule_conformance_kit_passes_for_builtin_rules(spmd_world, world):
    """Every builtin rule family under every input placement (a sample on the 2-D mesh) equals the
    op on the full tensors, outputs and gradients."""
    failures = spmd_world(world, "gloo").run(h.rule_conformance, CASES, 12 if world == 4 else 64, timeout=1200)
    assert failures[0] == {}, "\n\n".join(f"{k}: {v}" for k, v in failures[0].items())


def test_optimizer_steps_on_dtensor_parameters(spmd_world):
    for r in spmd_world(2, "gloo").run(h.foreach_adamw_step, timeout=120):
        assert r == {"True": True, "False": True}


def test_in_place_ops_keep_the_written_tensors_placement(spmd_world):
    for r in spmd_world(2, "gloo").run(h.in_place_keeps_placement, timeout=60):
        assert r == {"placements": ["Replicate()"], "values": True, "sharded": ["Shard(dim=0)"], "sharded_values": True}


def test_op_without_rule_falls_back_correctly_and_warns_once(spmd_world):
    for r in spmd_world(2, "gloo").run(h.fallback_warns_once, timeout=60):
        assert r["equal"] and r["placements"]
        assert len(r["messages"]) == 1 and "aten.cumsum.default" in r["messages"][0]


def test_plain_tensor_beside_dtensor_is_a_named_error(spmd_world):
    for message in spmd_world(2, "gloo").run(h.mixed_plain_tensor_error, timeout=60):
        assert message.startswith("MixedTensorError: aten.add.Tensor: got a plain torch.Tensor of shape (4, 2)")


def test_comm_debug_mode_counts_tensor_parallel_mlp(spmd_world):
    for r in spmd_world(2, "gloo").run(h.comm_counts_mlp, timeout=60):
        assert r["out_placements"] == ["Partial(sum)"]
        assert r["forward"] == {"all_reduce": 1}
        assert r["bytes"]["all_reduce"] == 4 * 8 * 4
        # backward of the all-reduce is free (Replicate -> Replicate); x's gradient is the only partial sum
        assert r["backward"] == {}


def test_third_party_rule_for_a_custom_op(spmd_world):
    pytest.importorskip("spmd_example_rules", reason="install examples/plugin-rules (the README's install does)")
    for r in spmd_world(2, "gloo").run(h.custom_op_rule_from_plugin, timeout=120):
        assert r["owner"] == "example_rules"
        assert r["placements"] == ["Shard(dim=0)"]
        assert r["equal"] and r["fallback_warnings"] == []


def test_conformance_kit_fails_a_wrong_rule_and_uses_rank_zeros_inputs(spmd_world):
    for r in spmd_world(2, "gloo").run(h.kit_verdicts, timeout=120):
        verdict = r["wrong_rule"]
        assert verdict.startswith("cumsum0") and "failed" in verdict, verdict
        failing = [line for line in verdict.splitlines()[1:] if line.startswith("mesh")]
        assert failing and all("Shard(dim=0)" in line for line in failing), verdict  # sharded on dim 1 it is right
        assert r["differing_inputs"] == 4, r["differing_inputs"]  # Replicate, Shard(0), Shard(1), Partial: all pass


def test_redistributed_tensors_own_their_data_and_uneven_from_local_fails_run_check(spmd_world):
    for r in spmd_world(2, "gloo").run(h.redistributed_tensors_own_their_data, timeout=60):
        assert r["Shard(dim=0)"] and r["Partial(sum)"], r
        assert "different global shapes" in r["uneven"] and "pass shape=" in r["uneven"], r["uneven"]


def test_a_rule_registered_or_removed_at_run_time_applies_to_an_op_already_dispatched(spmd_world):
    for seen in spmd_world(2, "gloo").run(h.rules_registered_and_removed_at_run_time):
        assert seen == ["before: (Shard(dim=0),)", "registered: (Replicate(),)", "unregistered: (Shard(dim=0),)"], seen


def test_a_rule_plugin_overrides_a_builtin_rule(spmd_world):
    for seen in spmd_world(2, "gloo").run(h.builtin_rule_overridden_by_a_plugin):
        assert seen == ["builtin: (Shard(dim=0),)", "overridden: (Replicate(),)", "plugin removed: (Shard(dim=0),)"], seen


def test_calls_without_a_mesh_share_the_worlds_default_mesh(spmd_world):
    for seen in spmd_world(2, "gloo").run(h.meshes_made_without_a_mesh):
        assert seen == {"tensors": True, "module": True, "fsdp": True}, seen
