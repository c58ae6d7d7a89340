"""A tensor-parallel torch script in the shape of pytorch/examples' tensor_parallel_example.py
and sequence_parallel_example.py, written for torch only (no init_process_group: the mesh creates the world).

    torchrun --nproc-per-node 2 examples/ports/tp_torch.py

Ported by one textual replacement in its import lines, ``torch.distributed`` -> ``spmd``
(tests/test_porting.py does exactly that and compares the losses with torch's).
"""

import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._tensor import Replicate, Shard
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.in_proj = nn.Linear(10, 32)
        self.relu = nn.ReLU()
        self.out_proj = nn.Linear(32, 5)

    def forward(self, x):
        return self.out_proj(self.relu(self.in_proj(x)))


class NormBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(10)
        self.mlp = ToyModel()

    def forward(self, x):
        return self.mlp(self.norm(x))


def main():
    world_size = int(os.environ["WORLD_SIZE"])
    mesh = init_device_mesh("cpu", (world_size,))
    rank = dist.get_rank()

    torch.manual_seed(0)
    tp_model = parallelize_module(ToyModel(), mesh, {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()})
    sp_model = parallelize_module(
        NormBlock(),
        mesh,
        {
            "norm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
            "mlp.in_proj": ColwiseParallel(),
            "mlp.out_proj": RowwiseParallel(output_layouts=Shard(1)),
        },
    )
    tp_opt = torch.optim.AdamW(tp_model.parameters(), lr=0.01, foreach=True)
    sp_opt = torch.optim.AdamW(sp_model.parameters(), lr=0.01, foreach=True)

    tp_losses, sp_losses = [], []
    for i in range(5):
        torch.manual_seed(i)  # the same input on every rank (tensor parallelism)
        inp = torch.rand(20, 10)
        loss = tp_model(inp).pow(2).mean()
        loss.backward()
        tp_opt.step()
        tp_opt.zero_grad()
        tp_losses.append(loss.item())

        torch.manual_seed(100 + i * world_size + rank)  # each rank its part of the sequence
        inp = torch.rand(4, 6, 10)
        out = sp_model(inp)  # this rank's part of the sequence
        loss = out.pow(2).mean()
        loss.backward()
        sp_opt.step()
        sp_opt.zero_grad()
        sp_losses.append(loss.item())

    row = {"rank": rank, "tp": tp_losses, "sp": sp_losses, "spmd": dist.__name__ == "spmd"}
    print("RESULT " + json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
