"""spmd.init() with no backend, then all_reduce of 4 B, 1 MiB and 16 MiB; prints RESULT with what happened."""

import json
import sys
import time

import torch

import spmd

spmd.init(timeout=30)
rank, world = spmd.get_rank(), spmd.get_world_size()
result: dict[str, object] = {"rank": rank}
start = time.monotonic()
try:
    for numel in (1, 1 << 18, 1 << 22):
        t = torch.arange(numel, dtype=torch.float32) + rank
        spmd.all_reduce(t)
        expected = torch.arange(numel, dtype=torch.float32) * world + sum(range(world))
        result[str(numel)] = bool(torch.equal(t, expected))
    result["backend"] = spmd.get_backend()
except Exception as error:  # noqa: BLE001 - reported
    result["error"] = type(error).__name__
    result["message"] = str(error)
result["elapsed"] = time.monotonic() - start
print("RESULT " + json.dumps(result), flush=True)
spmd.destroy_process_group()
sys.exit(1 if "error" in result else 0)
