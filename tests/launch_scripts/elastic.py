"""Elastic training stand-in: resumes from its own checkpoint, one step per all_reduce.

Writes the step and world size to a plain state dict after every step; a
restart with a new world size resumes from the saved step.
"""

import json
import os
import sys
import time

import torch

import spmd

ckpt, steps, pace = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
spmd.init("gloo", timeout=20)
state = {"step": 0, "history": []}
if os.path.exists(ckpt):
    state = torch.load(ckpt)
while state["step"] < steps:
    t = torch.ones(1)
    spmd.all_reduce(t)
    state["step"] += 1
    state["history"].append(int(t.item()))
    if spmd.get_rank() == 0:
        torch.save(state, ckpt + ".tmp")
        os.replace(ckpt + ".tmp", ckpt)
    time.sleep(pace)  # the workload's own pace, so a node can join mid-run
if spmd.get_rank() == 0:
    print("ELASTIC " + json.dumps(state), flush=True)
spmd.destroy_process_group()
