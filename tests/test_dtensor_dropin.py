"""DTensor as a drop-in for torch's, on 2 real ranks: a write through a view reaches its base or is refused with a
named error, never lost; kernels that conjugate inside compute what they do on plain tensors; the factories and
distribute_module behave as torch's."""

from __future__ import annotations

import dropin_helpers as h


def test_writes_through_views_reach_the_base_or_are_refused(spmd_world):
    for r in spmd_world(2, "gloo").run(h.views_and_writes, timeout=120):
        assert r["aliasing_view"]
        assert r["detached"].startswith("DetachedViewError") and "Shard(dim=1)" in r["detached"], r["detached"]
        assert r["row_slice"].startswith("DetachedViewError") and "aten.slice.Tensor" in r["row_slice"]
        assert r["y_kept"] and r["copy_is_fine"]
        assert r["in_place_views"]
        assert r["as_strided_"].startswith("InPlaceViewError") and "x = x.as_strided(...)" in r["as_strided_"]


def test_kernels_that_conjugate_inside_match_plain_torch(spmd_world):
    for r in spmd_world(2, "gloo").run(h.kernels_that_conjugate_inside, timeout=120):
        assert max(r.values()) <= 1e-5, r


def test_factories_and_distribute_module_as_torchs(spmd_world):
    for r in spmd_world(2, "gloo").run(h.factories_and_distribute_module, timeout=120):
        assert r["zeros"] and r["ones"] and r["full"], r
        assert r["rand_replicas_agree"] and r["rand_grad"], r
        assert r["module_out"], r
        assert r["placements"] == ["(Shard(dim=0),)"] + ["(Replicate(),)"] * 3, r
        assert r["twice"].startswith("RuntimeError: distribute_module was already called"), r
        assert r["table"] == [("0:2, 0:4", [0]), ("2:4, 0:4", [1])] and r["table_replicated"] == [("0:3", [0, 1])]
