"""pytorch/examples' distributed/tensor_parallelism/tensor_parallel_example.py, on CPU: Megatron-style
tensor parallelism of a two-linear MLP (first Linear split by columns, second by rows, one all-reduce).

    spmd run --nproc-per-node 2 examples/ports/tensor_parallel_example.py     # or: torchrun ...

The lines marked ``# port:`` are the only ones that differ from the torch version (the original's
imports, ``torch.distributed`` -> ``spmd``). CPU changes against the original: the mesh is on "cpu"
(no GPU check), the model is seeded so every rank builds the same weights, the optimizer's grads are
zeroed each step, and each rank prints its per-step losses as one ``RESULT {json}`` line.
"""

import json
import os

import torch
import torch.nn as nn
from log_utils import get_logger, rank_log

# the ported lines stay one line each (isort would wrap the long ones and move their '# port:' comments)
# isort: off
import spmd as dist  # port: import torch.distributed as dist
from spmd._tensor.device_mesh import init_device_mesh  # port: from torch.distributed._tensor.device_mesh import init_device_mesh
from spmd.tensor.parallel import (  # port: from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
# isort: on


class ToyModel(nn.Module):
    """The original's MLP: Linear(10, 32) -> ReLU -> Linear(32, 5)."""

    def __init__(self):
        super().__init__()
        self.in_proj = nn.Linear(10, 32)
        self.relu = nn.ReLU()
        self.out_proj = nn.Linear(32, 5)

    def forward(self, x):
        return self.out_proj(self.relu(self.in_proj(x)))


def main():
    logger = get_logger()
    world_size = int(os.environ["WORLD_SIZE"])
    device_type = "cpu"
    device_mesh = init_device_mesh(device_type=device_type, mesh_shape=(world_size,))
    rank = device_mesh.get_rank()
    assert world_size % 2 == 0, f"TP examples require an even number of ranks, got {world_size}"
    rank_log(rank, logger, f"Device Mesh created: {device_mesh=}")

    torch.manual_seed(0)  # the same weights on every rank: each keeps its slice of them
    tp_model = ToyModel().to(device_type)
    tp_model = parallelize_module(
        module=tp_model,
        device_mesh=device_mesh,
        parallelize_plan={"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()},
    )
    optimizer = torch.optim.AdamW(tp_model.parameters(), lr=0.25, foreach=True)

    losses = []
    for i in range(10):
        torch.manual_seed(i)  # for TP the input is the same on every rank (as a dataloader would give)
        inp = torch.rand(20, 10, device=device_type)
        loss = tp_model(inp).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        rank_log(rank, logger, f"Tensor Parallel iter {i} completed")

    print("RESULT " + json.dumps({"rank": rank, "losses": losses}), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
