"""fully_shard's set-up paths against torch's fully_shard in the same 2-rank world (and a one-process reference):
meta-device init, to_empty after fully_shard, load_state_dict(assign=True), FSDPModule, grouped modules,
cast_forward_inputs and set_gradient_divide_factor."""

from __future__ import annotations

import math

import fsdp_init_helpers as h
import pytest

TOL = 1e-5


def _same(ours, theirs, tol=TOL):
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert math.isclose(a, b, rel_tol=tol, abs_tol=tol), (ours, theirs)


def _moves(losses):
    """The loss curve moves: the forward reads the parameters the optimizer steps."""
    assert max(losses) - min(losses) > 1e-3, losses


def test_meta_init_to_empty_reset_parameters_trains_like_torch(spmd_world):
    for r in spmd_world(2, "gloo").run(h.meta_init, timeout=300):
        assert r["init_diff"] == 0.0  # the one-process init, exactly
        _same(r["ours"], r["torch"])
        _same(r["ours"], r["ref"])
        _moves(r["ours"])
        assert r["final_diff"] < 1e-5 and r["vs_torch"] < 1e-6, (r["final_diff"], r["vs_torch"])


def test_to_empty_after_fully_shard_and_assign_load_train_like_torch(spmd_world):
    for r in spmd_world(2, "gloo").run(h.cpu_to_empty_and_assign, timeout=300):
        assert r["to_empty_init_diff"] == 0.0
        _same(r["to_empty"], r["torch_to_empty"])
        _same(r["to_empty"], r["ref"])
        assert r["to_empty_final_diff"] < 1e-5
        for built in ("cpu", "meta"):
            assert r[f"assign_{built}_init_diff"] == 0.0
            _same(r[f"assign_{built}"], r["torch_assign"])
            _same(r[f"assign_{built}"], r["ref"])
            assert r[f"assign_{built}_final_diff"] < 1e-5
        _same(r["assign_sharded"], r["ref"])
        assert r["source_untouched"]
        _moves(r["to_empty"])
        assert r["step_changes_meta"] > 0 and r["step_changes_assign"] > 0


def test_fsdp_module_class_and_grouped_modules_train_like_torch(spmd_world):
    for r in spmd_world(2, "gloo").run(h.module_class_and_group, timeout=300):
        assert not r["before"]
        assert r["after"] == [True] * 4 and r["plain_parts"] == [False, False]
        assert r["names"] == r["torch_names"] == ["FSDPModel", "FSDPBlock", "FSDPLayerNorm", "FSDPLinear"]
        assert r["torch_isinstance"] and r["still_model"] and r["one_unit"] and r["units"] == 4
        assert r["errors"] == ["NotImplementedError", "NotImplementedError", "SpmdError", "SpmdError"]
        _same(r["ours"], r["torch"])
        _same(r["ours"], r["ref"])


@pytest.mark.parametrize("block_cast", [True, False])
def test_cast_forward_inputs_and_output_dtype_like_torch(spmd_world, block_cast):
    for r in spmd_world(2, "gloo").run(h.mixed_precision, block_cast, timeout=300):
        assert r["ours_dtype"] == r["torch_dtype"] == "torch.float32"
        _same(r["ours"], r["torch"])
        _moves(r["ours"])


def test_gradient_divide_factor_like_torch(spmd_world):
    for r in spmd_world(2, "gloo").run(h.divide_factor, 3.0, timeout=300):
        _same(r["ours"], r["torch"])
        _same(r["ours"], r["ref"])


def test_tied_weights_through_meta_and_double_after_fully_shard(spmd_world):
    for r in spmd_world(2, "gloo").run(h.tied_and_double, timeout=300):
        assert r["keys"] == ["emb.weight", "head.weight"] and r["still_tied"]
        _same(r["tied"], r["tied_ref"])
        assert r["dtype"] == "torch.float64"
        _same(r["double"], r["double_ref"])


def test_reshard_after_backward_false_never_trains_on_stale_parameters(spmd_world):
    for r in spmd_world(2, "gloo").run(h.kept_unsharded_after_backward, timeout=300):
        assert r["states"] == ["unsharded"] * 3  # kept after the last backward, as asked
        _same(r["ours"], r["ref"])
