"""pytorch/examples' distributed/tensor_parallelism/sequence_parallel_example.py, on CPU: the same
MLP as tensor_parallel_example.py with sequence parallelism (each rank its own rows of the input;
one all-gather before the column-split Linear, one reduce-scatter after the row-split one).

    spmd run --nproc-per-node 2 examples/ports/sequence_parallel_example.py     # or: torchrun ...

The lines marked ``# port:`` are the only ones that differ from the torch version. CPU changes against
the original: the mesh is on "cpu", the model and each rank's input are seeded (the input differs by
rank, as the original's comment intends), grads are zeroed each step, and each rank prints its
per-step losses (the sum of its own output rows) as one ``RESULT {json}`` line.
"""

import json
import os

import torch
import torch.nn as nn
from log_utils import get_logger, rank_log

# the ported lines stay one line each (isort would wrap the long ones and move their '# port:' comments)
# isort: off
import spmd as dist  # port: import torch.distributed as dist
from spmd._tensor import Shard  # port: from torch.distributed._tensor import Shard
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
    device_type = "cpu"
    device_mesh = init_device_mesh(device_type=device_type, mesh_shape=(int(os.environ["WORLD_SIZE"]),))
    rank = device_mesh.get_rank()
    rank_log(rank, logger, f"Device Mesh created: {device_mesh=}")

    torch.manual_seed(0)
    model = ToyModel().to(device_type)
    sp_model = parallelize_module(
        module=model,
        device_mesh=device_mesh,
        parallelize_plan={
            "in_proj": ColwiseParallel(input_layouts=Shard(0)),
            "out_proj": RowwiseParallel(output_layouts=Shard(0)),
        },
    )
    optimizer = torch.optim.AdamW(sp_model.parameters(), lr=0.25, foreach=True)

    losses = []
    for i in range(10):
        torch.manual_seed(100 * i + rank)  # for SP each rank has its own rows of the sequence
        inp = torch.rand(20, 10, device=device_type)
        loss = sp_model(inp).sum()  # this rank's rows of the output
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        rank_log(rank, logger, f"Sequence Parallel iter {i} completed")

    print("RESULT " + json.dumps({"rank": rank, "losses": losses}), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
