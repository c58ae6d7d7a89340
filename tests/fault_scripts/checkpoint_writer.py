"""Saves that a test watches from outside their process (run by test_checkpoint_writers.py).

    python checkpoint_writer.py hold PATH SEED            # one process: save through held://PATH (its commit waits for PATH.go)
    python checkpoint_writer.py killed PATH SEED          # one process: killed half-way through writing its data
    python checkpoint_writer.py async-alone PATH          # one process: an async_save that fails, then the end
    python checkpoint_writer.py commit-dies BACKEND PATH  # 2 ranks: rank 0 dies right after its commit
    python checkpoint_writer.py async BACKEND PATH MODE   # 2 ranks: async_save then MODE (see below)

async MODEs: "destroy" (slow writes, then destroy_process_group at once), "failing-destroy" (rank 1's write
fails, nobody asks the future, then destroy_process_group), "failing-exit" (the same, then the end of the
script without destroy). Each prints what it reached ("saved", "committed", "destroyed", "end").
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # checkpoint_helpers and checkpoint_plugin

import checkpoint_helpers as h  # noqa: E402

import spmd  # noqa: E402
import spmd.checkpoint as dcp  # noqa: E402

h.use_test_storage()
mode = sys.argv[1]
if mode in ("hold", "killed"):
    path, seed = sys.argv[2], int(sys.argv[3])
    try:
        dcp.save(h.writer_state(seed), checkpoint_id=f"{'held' if mode == 'hold' else 'killed'}://{path}")
    except dcp.CheckpointError as error:
        print(f"{type(error).__name__}: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    print("saved", flush=True)
elif mode == "async-alone":
    dcp.async_save(h.writer_state(1), checkpoint_id=f"full://{sys.argv[2]}")
    print("end", flush=True)
elif mode == "commit-dies":
    backend, path = sys.argv[2], sys.argv[3]
    spmd.init(backend)
    dcp.save(h.writer_state(1), checkpoint_id=f"commit-dies://{path}")
    print(spmd.get_rank(), "committed", flush=True)
elif mode == "async":
    backend, path, how = sys.argv[2], sys.argv[3], sys.argv[4]
    spmd.init(backend)
    scheme = "slow" if how == "destroy" else "failing"
    dcp.async_save(h.writer_state(2), checkpoint_id=f"{scheme}://{path}")
    if how != "failing-exit":
        spmd.destroy_process_group()
        print(spmd.is_initialized() and "still initialised" or "destroyed", flush=True)
    print("end", flush=True)
