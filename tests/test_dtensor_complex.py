"""Complex DTensors and torch's operator database on 2 real ranks: rotary embeddings with heads sharded against
one process, the conjugate and negative bits, and the op_db sweep (a fast subset here; the whole database under
the ``slow`` marker) with spmd's counts beside torch's own DTensor on the same samples."""

from __future__ import annotations

import complex_helpers as h
import pytest

from spmd.testing import opdb


def test_rotary_attention_with_sharded_heads_matches_one_process(spmd_world):
    for r in spmd_world(2, "gloo").run(h.rotary_attention_heads_sharded, timeout=120):
        assert r["out"] <= 1e-6 and max(r["grads"]) <= 1e-6, r
        assert r["abs2"] <= 1e-6 and r["abs2_sharded"] <= 1e-6  # z * conj(z) is |z|^2 (it was z^2: off by about 1)
        assert r["bits"] == (True, True, True)  # conj and neg views keep their bits, as torch's tensors do
        assert r["conj_sharded"] and r["real_of_conj"]


def test_op_db_fast_subset_has_no_silent_mismatch(spmd_world):
    r = spmd_world(2, "gloo").run(h.sweep_counts, list(opdb.FAST_OPS), False, timeout=300)[0]
    assert r["mismatches"] == [], "\n".join(r["mismatches"][:20])
    assert r["spmd"]["match"] > 1000, r  # the subset has about 1300 cases: a sweep that ran nothing must fail


def test_op_db_sample_against_torchs_dtensor(spmd_world):
    """Two samples per op of the subset on torch's DTensor too (it takes ~0.1 s a case here): spmd gets as many right."""
    r = spmd_world(2, "gloo").run(h.sweep_counts, list(opdb.FAST_OPS), True, 2, timeout=600)[0]
    assert r["mismatches"] == []
    assert r["spmd"]["match"] >= r["torch"]["match"], r


@pytest.mark.slow
def test_op_db_whole_sweep_has_no_silent_mismatch(spmd_world):
    r = spmd_world(2, "gloo").run(h.sweep_counts, None, True, timeout=7200)[0]
    print(r["spmd"], r["torch"])
    assert r["mismatches"] == [], "\n".join(r["mismatches"][:50])
    assert r["spmd"]["match"] >= r["torch"]["match"], r
