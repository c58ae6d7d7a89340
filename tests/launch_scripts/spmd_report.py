"""The same report as report.py, through spmd.init() with no arguments."""

import json
import os
import sys

import torch

import spmd

spmd.init()
t = torch.tensor([float(spmd.get_rank())])
spmd.all_reduce(t)
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RESTART_COUNT", "SPMD_RESTART_COUNT", "OMP_NUM_THREADS"]
print("REPORT " + json.dumps({"env": {k: os.environ.get(k) for k in keys}, "sum": t.item(), "args": sys.argv[1:]}), flush=True)
spmd.destroy_process_group()
