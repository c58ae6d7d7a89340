"""Elastic membership: a job that survives nodes joining and leaving by resuming from its checkpoint.

    # node A (starts alone: MIN is 1)
    spmd run --nnodes 1:2 --nproc-per-node 1 --rdzv-endpoint 127.0.0.1:29400 --rdzv-id demo \
        examples/elastic_resume.py /tmp/elastic.pt 200 0.05
    # node B, any time later: both restart as a world of two and resume
    spmd run --nnodes 1:2 --nproc-per-node 1 --rdzv-endpoint 127.0.0.1:29400 --rdzv-id demo \
        examples/elastic_resume.py /tmp/elastic.pt 200 0.05

Arguments: checkpoint path, total steps, seconds per step, and optionally the
world size to wait for (keep stepping past the total until it is reached). Every step all-reduces
a one and records the sum (the world size at that step) in a plain state dict
that rank 0 saves atomically; after a restart with a new world size the script
resumes from the saved step. ``history`` shows the world growing.
"""

import json
import os
import sys
import time

import torch

import spmd

ckpt, steps, pace = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
min_world = int(sys.argv[4]) if len(sys.argv) > 4 else 1  # keep stepping until this many ranks joined
spmd.init("gloo", timeout=20)
state = {"step": 0, "history": []}
if os.path.exists(ckpt):
    state = torch.load(ckpt)
while state["step"] < steps or spmd.get_world_size() < min_world:
    t = torch.ones(1)
    spmd.all_reduce(t)
    state["step"] += 1
    state["history"].append(int(t.item()))
    if spmd.get_rank() == 0:
        torch.save(state, ckpt + ".tmp")
        os.replace(ckpt + ".tmp", ckpt)
    time.sleep(pace)  # the workload's own pace, so a node can join mid-run
if spmd.get_rank() == 0:
    print("ELASTIC " + json.dumps({**state, "world_size": spmd.get_world_size()}), flush=True)
spmd.destroy_process_group()
