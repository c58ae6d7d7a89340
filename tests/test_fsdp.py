"""fully_shard on 2 and 4 real ranks against a single-process reference trained on the whole batch."""

from __future__ import annotations

import math

import fsdp_helpers as h
import pytest
import torch
from train_runs import run_train

from spmd.tensor.placements import chunk_sizes

LOSS_TOL, PARAM_TOL = 1e-5, 1e-5


def _check(results, loss_tol=LOSS_TOL, param_tol=PARAM_TOL, world=None):
    for rank, r in enumerate(results):
        for ours, ref in zip(r["losses"], r["ref_losses"]):
            assert math.isclose(ours, ref, rel_tol=loss_tol, abs_tol=loss_tol), (rank, r["losses"], r["ref_losses"])
        assert r["keys"], rank
        assert r["max_param_diff"] < param_tol, (rank, r["diffs"])
        assert r["grads_none"]
        if world:
            for name, (rows, total) in r["local_rows"].items():  # torch.chunk's rows, at most ceil(total / world)
                assert rows == chunk_sizes(total, world)[rank] <= -(-total // world), (name, rank, rows)


@pytest.mark.parametrize("world", [2, 4])
def test_adamw_steps_match_single_process_reference(spmd_world, world):
    _check(spmd_world(world, "gloo").run(h.train_against_reference, (world,), timeout=300), world=world)


def test_on_a_backend_with_a_true_reduce_scatter(spmd_world):
    """Gloo's reduce-scatter all-reduces an input copy, so FSDP all-reduces its scratch buffer in place
    there; the isend/irecv-only example backend takes the reduce_scatter_tensor path instead."""
    _check(spmd_world(2, "p2p").run(h.train_against_reference, (2,), timeout=300))


def test_without_reshard_after_forward(spmd_world):
    _check(spmd_world(2, "gloo").run(h.train_against_reference, (2,), reshard_after_forward=False, timeout=300))


def test_gradient_accumulation_without_sync(spmd_world):
    _check(spmd_world(2, "gloo").run(h.train_against_reference, (2,), accumulate=3, timeout=300))


def test_hsdp_on_a_2x2_mesh(spmd_world):
    _check(spmd_world(4, "gloo").run(h.train_against_reference, (2, 2), timeout=300))


def test_hsdp_accumulation_with_set_requires_all_reduce(spmd_world):
    _check(spmd_world(4, "gloo").run(h.train_against_reference, (2, 2), accumulate=2, sync="all_reduce", timeout=300))


def test_bf16_mixed_precision_against_bf16_reference(spmd_world):
    _check(spmd_world(2, "gloo").run(h.train_against_reference, (2,), param_dtype=torch.bfloat16, timeout=300),
           loss_tol=2e-2, param_tol=3e-2)


@pytest.mark.parametrize("reshard", [True, False])
def test_one_all_gather_per_unit_per_forward(spmd_world, reshard):
    for r in spmd_world(2, "gloo").run(h.count_collectives, reshard, timeout=120):
        for fwd, bwd in r["counts"]:
            assert fwd == {"all_gather": 4}  # 3 blocks and the root, one flat all-gather each
            # backward gathers again what forward freed (the blocks; never the root) and reduces each unit once
            assert bwd == ({"all_gather": 3, "reduce_scatter": 4} if reshard else {"reduce_scatter": 4})
        assert r["eval"] == {"all_gather": 4}
        assert r["states"] == ["sharded"] * 4


def test_state_dict_round_trips(spmd_world):
    for rank, r in enumerate(spmd_world(2, "gloo").run(h.state_dict_round_trips, timeout=120)):
        assert r["kinds"] == ["DTensor"]
        assert r["b"] and r["c"] and r["d"] and r["plain"] and r["shards_are_views"]
        assert r["rank0_keys"] == (22 if rank == 0 else 0)


def test_unshard_reshard_prefetch_lists_and_strategy_by_name(spmd_world):
    for r in spmd_world(2, "gloo").run(h.unshard_and_strategy, timeout=120):
        assert r["units"] == 4
        assert r["state"] == "unsharded" and r["after"] == "sharded"
        assert r["grads"]
        assert math.isclose(*r["norm"], rel_tol=1e-5) and r["norm"][1] > 0.05 and r["clipped"]
        assert math.isclose(*r["inf_norm"], rel_tol=1e-6) and r["inf_norm"][1] > 0, r["inf_norm"]


def test_train_example_fsdp_follows_ddp_loss_curve(tmp_path):
    """examples/train.py --strategy fsdp prints DDP's losses (4 decimals) and saves a plain state dict."""
    curves = {}
    for strategy in ("ddp", "fsdp"):
        curves[strategy] = run_train(2, ["--strategy", strategy], tmp_path / f"{strategy}.pt", steps=6)
    assert len(curves["fsdp"]) == 6 and curves["fsdp"] == curves["ddp"], curves
    ddp, fsdp = torch.load(tmp_path / "ddp.pt"), torch.load(tmp_path / "fsdp.pt")
    assert ddp.keys() == fsdp.keys() and all(type(v) is torch.Tensor for v in fsdp.values())
    assert max((ddp[k] - fsdp[k]).abs().max().item() for k in ddp) < 1e-5
