"""DTensor views and in-place writes on 2 real ranks: a write through a view reaches its base or is refused with a
named error, never lost; kernels that conjugate inside compute what they do on plain tensors."""

from __future__ import annotations

import aliasing_helpers as h


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
