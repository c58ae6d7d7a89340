"""A small torchrun script of the common shape: env:// init, DistributedSampler(ds) with no arguments, all_reduce'd metrics.

    spmd run --nproc-per-node 2 examples/ports/torchrun_sampler.py     # or: torchrun --nproc-per-node 2 ...

Ported from torch.distributed by changing the line marked ``# port:`` only:
DistributedSampler asks torch.distributed for the rank and world size, and
finds spmd's group there.
"""

import json
import os

import torch
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import spmd as dist  # port: import torch.distributed as dist


def main():
    dist.init_process_group(backend="gloo", init_method="env://")
    local_rank = int(os.environ["LOCAL_RANK"])
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(100, 4, generator=g), torch.randn(100, generator=g))
    sampler = DistributedSampler(ds)
    loader = DataLoader(ds, batch_size=10, sampler=sampler)
    seen = torch.zeros(1)
    total = torch.zeros(1)
    for x, y in loader:
        seen += x.shape[0]
        total += (x.sum(dim=1) - y).abs().sum()
    dist.all_reduce(seen, op=dist.ReduceOp.SUM)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    dist.barrier()
    if rank == 0:
        print(f"world {world}: {int(seen.item())} samples, mean error {total.item() / seen.item():.5f}")
    print("RESULT " + json.dumps({"rank": rank, "local_rank": local_rank, "seen": seen.item(), "error": round(total.item(), 4), "indices": list(sampler)[:5]}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
