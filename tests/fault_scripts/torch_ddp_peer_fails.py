"""torch's own DistributedDataParallel over spmd's process group, with rank 1 killed or raising at step 3:
the survivor must get a Python exception from backward (it died with SIGSEGV in DDP's reducer before).
Run by test_torch_bridge_failures.py.

    python torch_ddp_peer_fails.py BACKEND MODE    # MODE: kill (SIGKILL) or raise (an exception in forward)
"""

import os
import signal
import sys

import torch
import torch.distributed as tdist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import spmd

backend, mode = sys.argv[1], sys.argv[2]
spmd.init(backend, timeout=15)
rank = tdist.get_rank()
torch.manual_seed(0)
model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(10):
    if rank == 1 and step == 3:
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError("rank 1 fails in forward")
    loss = model(torch.randn(8, 16)).square().mean()
    try:
        loss.backward()
    except Exception as error:  # noqa: BLE001 - what the survivor sees is the point
        print("SURVIVOR", type(error).__name__, str(error).splitlines()[0], flush=True)
        sys.exit(3)
    optimizer.step()
    optimizer.zero_grad()
print(rank, "finished all steps", flush=True)
