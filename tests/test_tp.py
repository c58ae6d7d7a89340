"""Tensor and sequence parallelism on 2 real ranks against the same model in one process."""

from __future__ import annotations

import pytest
import tp_helpers as h

TOL = 1e-5


def test_colwise_then_rowwise_mlp(spmd_world):
    for r in spmd_world(2, "gloo").run(h.mlp_colwise_rowwise, timeout=120):
        assert r["plain_output"]  # use_local_output: a plain tensor out, as torch
        assert r["output"] < TOL and max(r["grads"].values()) < TOL, r
        assert r["placements"] == {
            "fc1.weight": ["Shard(dim=0)"], "fc1.bias": ["Shard(dim=0)"],
            "fc2.weight": ["Shard(dim=1)"], "fc2.bias": ["Replicate()"],
        }


def test_transformer_block_with_split_heads_and_sequence_parallel_norms(spmd_world):
    for r in spmd_world(2, "gloo").run(h.sequence_parallel_block, timeout=180):
        assert r["out_placements"] == ["Shard(dim=1)"]
        assert r["output"] < TOL, r
        assert max(r["grads"].values()) < TOL, r["grads"]
        # one all-gather and one reduce-scatter per sub-layer and direction, no all-reduce
        assert r["forward"] == {"all_gather": 2, "reduce_scatter": 2}, r["forward"]
        assert r["backward"] == {"all_gather": 2, "reduce_scatter": 2}, r["backward"]  # the adjoints


def test_vocabulary_parallel_embedding_and_loss_parallel(spmd_world):
    for r in spmd_world(2, "gloo").run(h.embedding_and_loss_parallel, timeout=180):
        assert r["logits"] == ["Shard(dim=2)"]
        assert r["embed"] == ["Shard(dim=0)"]
        assert r["loss"] < TOL and max(r["grads"].values()) < TOL, r
        assert r["gathered_logits"] == 0  # the class dimension was never gathered


def test_wildcard_plan_named_style_and_third_party_style(spmd_world):
    for r in spmd_world(2, "gloo").run(h.wildcard_plan_and_custom_style, timeout=120):
        assert r["placements"]["layers.1.fc1.weight"] == ["Shard(dim=0)"]
        assert r["placements"]["layers.0.fc2.weight"] == ["Shard(dim=1)"]
        assert r["doubled"] == [2.0, 2.0]
        assert "matches no submodule" in r["missing"]


@pytest.mark.parametrize("style", ["tp.colwise", "tp.rowwise", "tp.sequence"])
def test_styles_are_registered_strategies(style):
    from spmd.parallel import get_strategy

    assert hasattr(get_strategy(style).apply(), "apply")
