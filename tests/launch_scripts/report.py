"""Uses only torchrun's variables and plain torch.distributed: must run unchanged under `spmd run`."""

import json
import os
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")  # env:// from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
t = torch.tensor([float(dist.get_rank())])
dist.all_reduce(t)
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RESTART_COUNT", "SPMD_RESTART_COUNT", "OMP_NUM_THREADS"]
print("REPORT " + json.dumps({"env": {k: os.environ.get(k) for k in keys}, "sum": t.item(), "args": sys.argv[1:]}), flush=True)
dist.destroy_process_group()
