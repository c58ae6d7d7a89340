"""spmd.init(torch_interop=False) or SPMD_TORCH_INTEROP=0 leaves torch.distributed alone."""

import json
import sys

import torch.distributed as tdist

import spmd

spmd.init("gloo", torch_interop=False) if sys.argv[1:] == ["kwarg"] else spmd.init("gloo")
print("REPORT " + json.dumps({"torch_initialized": tdist.is_initialized(), "rank": spmd.get_rank()}), flush=True)
spmd.destroy_process_group()
