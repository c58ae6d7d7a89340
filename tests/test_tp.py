"""Tensor and sequence parallelism on 2 real ranks against the same model in one process."""

from __future__ import annotations

import pytest
import tp_helpers as h
from train_runs import assert_same_state, losses, run_train

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
        # the norms' replicated parameters get partial gradients (sums over each rank's part of the
        # sequence), reduced once by the optimizer step (the row-parallel biases are added before the
        # reduce-scatter, so their gradients arrive whole)
        assert r["partial_grads"] == ["norm1.bias", "norm1.weight", "norm2.bias", "norm2.weight"]
        assert r["step"] == {"all_reduce": len(r["partial_grads"])}, r["step"]
        assert r["second_forward"] == r["forward"], r["second_forward"]
        assert all(r["placements_after_step"][n] == ["Replicate()"] for n in r["partial_grads"]), r["placements_after_step"]


def test_vocabulary_parallel_embedding_and_loss_parallel(spmd_world):
    for r in spmd_world(2, "gloo").run(h.embedding_and_loss_parallel, timeout=180):
        assert r["logits"] == ["Shard(dim=2)"]
        assert r["embed"] == ["Shard(dim=0)"]
        assert r["loss"] < TOL and max(r["grads"].values()) < TOL, r
        assert r["gathered_logits"] == 0  # the class dimension was never gathered


def test_loss_parallel_with_a_rank_that_holds_no_class(spmd_world):
    results = spmd_world(4, "gloo").run(h.loss_parallel_with_a_rank_holding_no_class, timeout=120)
    assert [r["local_classes"] for r in results] == [2, 2, 2, 0]
    assert all(r["loss"] < TOL and r["grad"] < TOL for r in results), results


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


def test_train_example_tensor_parallel_follows_one_process(tmp_path):
    """examples/train.py --tp 2 on 2 ranks trains like one process on the same data (heads, MLP and
    vocabulary split; loss_parallel), and saves a plain state dict."""

    single = losses(run_train(1, [], tmp_path / "one.pt"))
    tensor_parallel = losses(run_train(2, ["--tp", "2"], tmp_path / "tp.pt"))
    assert len(single) == 5 and max(abs(a - b) for a, b in zip(single, tensor_parallel)) < 2e-4, (single, tensor_parallel)
    assert_same_state(tmp_path / "one.pt", tmp_path / "tp.pt")


def test_train_example_two_dimensional_tensor_and_data_parallel(tmp_path):
    """--tp 2 on 4 ranks (a (2, 2) mesh: tensor parallel x 2 data-parallel replicas) follows DDP on 2 ranks."""
    ddp = losses(run_train(2, [], tmp_path / "ddp.pt"))
    two_d = losses(run_train(4, ["--tp", "2"], tmp_path / "2d.pt"))
    assert len(ddp) == 5 and max(abs(a - b) for a, b in zip(ddp, two_d)) < 2e-4, (ddp, two_d)


def test_tensor_parallel_inside_fsdp_on_a_two_by_two_mesh(spmd_world):
    """2-D: parallelize_module over mesh['tp'], fully_shard over mesh['dp']: 3 SGD steps (with
    clip_grad_norm_) follow one process on the whole batch; tp-sharded weights gain Shard(0) over dp."""
    for r in spmd_world(4, "gloo").run(h.tensor_parallel_inside_fsdp, timeout=300):
        assert r["loss"] < TOL and r["norm"] < TOL and r["params"] < 1e-5, r
        assert r["keys"] and r["reloaded"]
        # q.weight (8, 8): rows split over tp (4 each), then those rows over dp (2 each)
        assert r["q_layout"] == (("tp", "dp"), ["Shard(dim=0)", "Shard(dim=0)"], (2, 8)), r["q_layout"]
        assert r["norm_layout"] == ["Replicate()", "Shard(dim=0)"]


def test_train_example_tensor_parallel_inside_fsdp(tmp_path):
    """The README's 2-D command: --strategy fsdp --dp 2 --tp 2 on 4 ranks follows DDP on 2 ranks, and saves
    the same plain state dict."""

    ddp = losses(run_train(2, [], tmp_path / "ddp.pt"))
    two_d = losses(run_train(4, ["--strategy", "fsdp", "--dp", "2", "--tp", "2"], tmp_path / "2d.pt"))
    assert len(ddp) == 5 and max(abs(a - b) for a, b in zip(ddp, two_d)) < 2e-4, (ddp, two_d)
    assert_same_state(tmp_path / "ddp.pt", tmp_path / "2d.pt")
