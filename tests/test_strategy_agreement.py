"""Strategies agree at set-up: fully_shard, parallelize_module and the pipeline schedule compare what they shard
(parameter names, order, shapes, dtypes; the plan; the schedule and microbatch count) across ranks, and a rank
set up differently makes every rank raise at once, naming the first difference (it trained on garbage before)."""

from __future__ import annotations

import agreement_helpers as h
import pytest


@pytest.mark.parametrize("backend", ["gloo", "p2p"])
def test_a_rank_set_up_differently_is_refused_on_every_rank(spmd_world, backend):
    for r in spmd_world(2, backend).run(h.disagreeing_set_ups, timeout=120):
        for case in ("fsdp_order", "fsdp_shape", "fsdp_extra"):
            assert r[case].startswith("SpmdError: fully_shard: the ranks of group"), (case, r[case])
            assert "wrap different models" in r[case]
        assert "entry #0: rank 0 has ('a.weight', (4, 4), 'torch.float32'), group rank 1 has ('b.weight'" in r["fsdp_order"]
        assert "(5, 4)" in r["fsdp_shape"] and "rank 0 has 4 entries, group rank 1 has 6" in r["fsdp_extra"]
        assert r["fsdp_same"] == "no error" and r["tp_same"] == "no error"
        assert r["tp_plan"].startswith("SpmdError: parallelize_module:") and "RowwiseParallel" in r["tp_plan"]
        assert r["pipeline"].startswith("SpmdError: pipeline schedule:") and "('microbatches', 2)" in r["pipeline"]
        assert "('schedule', '1f1b')" in r["pipeline_schedule"] and "gpipe" in r["pipeline_schedule"]


@pytest.mark.parametrize(("world", "fail_on_rank"), [(2, 1), (4, 2)])
def test_a_stage_that_raises_makes_every_rank_raise_within_seconds(spmd_world, world, fail_on_rank):
    results = spmd_world(world, "gloo").run(h.a_stage_raises, fail_on_rank, timeout=120)
    assert results[fail_on_rank].startswith("ValueError: bad batch in the stage's forward"), results
    for rank, r in enumerate(results):
        seconds = float(r.rsplit("[", 1)[1].split(" s]")[0])
        assert seconds < 5.0, (rank, r)  # not the collective timeout (30 s here)
        if rank != fail_on_rank:
            assert f"group rank {fail_on_rank} raised in pipeline step" in r and "bad batch" in r, (rank, r)
