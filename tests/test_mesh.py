"""DeviceMesh on real ranks: layout, sub-meshes, lazily created groups, per-dimension backends, errors."""

from __future__ import annotations

import dtensor_helpers as h
import pytest


def test_two_by_two_mesh_is_row_major_with_named_sub_meshes(spmd_world):
    results = spmd_world(4, "gloo").run(h.mesh_facts, timeout=120)
    for rank, r in enumerate(results):
        dp, tp = divmod(rank, 2)
        assert r["coordinate"] == [dp, tp]
        assert r["local"] == (dp, tp)
        assert r["shape"] == (2, 2) and r["size"] == (4, 2)
        assert r["tp_ranks"] == [2 * dp, 2 * dp + 1]
        assert r["dp_ranks"] == [tp, tp + 2]
        assert r["same_group"]  # a sub-mesh uses its parent's group, created once
        assert r["tp_sum"] == float(2 * dp + 2 * dp + 1)
        errors = r["errors"]
        assert "holds 6 ranks but the world has 4" in errors["product"]
        assert "repeat a name" in errors["duplicate"]
        assert "one name per dimension" in errors["count"]
        assert "no dimension 'pp'" in errors["unknown"] and "['dp', 'tp']" in errors["unknown"]
        assert "outside the world of 4 ranks" in errors["outside"]
        assert "lists a rank twice" in errors["repeat"]


def test_sub_mesh_in_another_dimension_order(spmd_world):
    for r in spmd_world(4, "gloo").run(h.mesh_facts, timeout=120):
        assert r["swapped"] == [[0, 2], [1, 3]]  # mesh["tp", "dp"]: the grid transposed


def test_backend_per_mesh_dimension(spmd_world):
    pytest.importorskip("spmd_example_p2p")
    for r in spmd_world(4, "gloo").run(h.per_dimension_backend, timeout=120):
        assert r == {"tp": "p2p", "dp": "gloo", "equal": True, "override_tp": "p2p"}
