# ruff: noqa: I001  (the ported import lines carry their torch original as a trailing comment)
"""The pattern of pytorch/examples' ddp/example.py: torchrun, LOCAL_RANK, devices per process, a ToyModel.

    spmd run --nproc-per-node 2 examples/ports/ddp_example.py --local-world-size 2

Ported from torch.distributed by changing the lines marked ``# port:`` only.
"""

import argparse
import json
import os

import torch
import torch.nn as nn
import torch.optim as optim

import spmd as dist  # port: import torch.distributed as dist
from spmd.parallel import DistributedDataParallel as DDP  # port: from torch.nn.parallel import DistributedDataParallel as DDP


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def demo_basic(local_world_size, local_rank):
    # The example gives each process n = GPUs / local_world_size devices; with none, the model stays on CPU.
    n = torch.cuda.device_count() // local_world_size
    device_ids = list(range(local_rank * n, (local_rank + 1) * n)) or None
    print(f"[{os.getpid()}] rank = {dist.get_rank()}, world_size = {dist.get_world_size()}, n = {n}, device_ids = {device_ids}")
    torch.manual_seed(dist.get_rank())
    model = ToyModel()
    ddp_model = DDP(model, device_ids)
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)
    for _ in range(5):
        optimizer.zero_grad()
        outputs = ddp_model(torch.randn(20, 10))
        labels = torch.randn(20, 5)
        loss_fn(outputs, labels).backward()
        optimizer.step()
    weights = [round(w, 6) for w in model.net2.weight.flatten().tolist()[:5]]
    print("RESULT " + json.dumps({"rank": dist.get_rank(), "weights": weights}), flush=True)


def spmd_main(local_world_size, local_rank):
    env_dict = {key: os.environ[key] for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    print(f"[{os.getpid()}] Initializing process group with: {env_dict}")
    dist.init_process_group(backend="gloo")
    print(f"[{os.getpid()}]: world_size = {dist.get_world_size()}, rank = {dist.get_rank()}, backend={dist.get_backend()}")
    demo_basic(local_world_size, local_rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--local-rank", "--local_rank", type=int, default=0)
    parser.add_argument("--local-world-size", "--local_world_size", type=int, default=1)
    args = parser.parse_args()
    spmd_main(args.local_world_size, int(os.environ.get("LOCAL_RANK", args.local_rank)))
