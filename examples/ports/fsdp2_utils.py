# ruff: noqa: I001  (the ported import lines carry their torch original as a trailing comment)
"""The checks of pytorch/examples' distributed/FSDP2/utils.py, for fsdp2_example.py.

Ported from torch.distributed by changing the lines marked ``# port:`` only.
"""

import torch
from fsdp2_model import Transformer
from spmd.fsdp import FSDPModule  # port: from torch.distributed.fsdp import FSDPModule
from spmd.tensor import Shard  # port: from torch.distributed.tensor import Shard


def inspect_model(model: FSDPModule):
    assert isinstance(model, Transformer)  # fully_shard swaps the class to a subclass of both
    assert isinstance(model, FSDPModule)
    if torch.distributed.get_rank() == 0:
        print(model)
    for param in model.parameters():
        assert param.placements == (Shard(0),)
        assert param.dtype == torch.float32


def inspect_mixed_precision(model: FSDPModule):
    model.unshard()
    for param in model.parameters(recurse=False):
        assert param.dtype == torch.bfloat16
    model.reshard()
