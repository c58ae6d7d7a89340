"""A small torchrun script of the other common shape: objects and tensors gathered for evaluation, a guarded init.

    spmd run --nproc-per-node 2 examples/ports/torchrun_objects.py     # or: torchrun --nproc-per-node 2 ...

Ported from torch.distributed by changing the line marked ``# port:`` only.
"""

import json
import os

import torch

import spmd as dist  # port: import torch.distributed as dist


def setup():
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def main():
    rank, world = setup()
    preds = torch.arange(4, dtype=torch.float32) + 4 * rank
    gathered = [torch.zeros_like(preds) for _ in range(world)]
    dist.all_gather(gathered, preds)
    stats = {"rank": rank, "host": "node0", "n": int(preds.numel())}
    everyone = [None] * world
    dist.all_gather_object(everyone, stats)
    config = [{"lr": 0.1, "seed": 42}] if rank == 0 else [None]
    dist.broadcast_object_list(config, src=0)
    best = torch.tensor([float(preds.max())])
    dist.reduce(best, dst=0, op=dist.ReduceOp.MAX)
    result = {"rank": rank, "gathered": torch.cat(gathered).tolist(), "everyone": everyone, "config": config[0]}
    if rank == 0:
        result["best"] = best.item()
    print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
