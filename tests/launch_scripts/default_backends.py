"""spmd.init() with no backend on a 2 x (world / 2) HSDP-style mesh: which backend each group got, and its sums.

Ranks 0..n/2-1 and n/2..n-1 are the two "nodes" (spmd run --nproc-per-node n/2 on each): the
``shard`` groups stay inside a node, the ``replicate`` groups cross them. Prints one REPORT line.
"""

import json
import os

import torch

import spmd

spmd.init()
rank, world = spmd.get_rank(), spmd.get_world_size()
mesh = spmd.init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
report = {"rank": rank, "world": spmd.get_backend(), "store": os.environ.get("SPMD_AGENT_STORE", "").partition(":")[0]}
for dim in ("replicate", "shard"):
    group = mesh.get_group(dim)
    t = torch.tensor([float(rank + 1)])
    spmd.all_reduce(t, group=group)
    members = spmd.get_process_group_ranks(group)
    report[dim] = {"backend": spmd.get_backend(group), "sum": t.item(), "expected": float(sum(r + 1 for r in members))}
t = torch.tensor([float(rank + 1)])
spmd.all_reduce(t)
report["world_sum"] = [t.item(), float(world * (world + 1) // 2)]
print("REPORT " + json.dumps(report), flush=True)
spmd.destroy_process_group()
