# ruff: noqa: I001  (the ported import lines carry their torch original as a trailing comment)
"""The Checkpointer of pytorch/examples' distributed/FSDP2/checkpoint.py, for fsdp2_example.py.

Both forms write full (unsharded) state dicts with ``torch.save`` on rank 0, as the original does:
``dcp_api=True`` gathers and scatters through ``get_/set_model_state_dict`` and
``get_/set_optimizer_state_dict`` (``StateDictOptions(full_state_dict=True, cpu_offload=True)``, loading with
``broadcast_from_rank0=True``); ``dcp_api=False`` does it by hand with DTensor's ``full_tensor()`` and
``distribute_tensor``, then ``load_state_dict(assign=True)``. The files hold plain tensors only.

Ported from torch.distributed by changing the lines marked ``# port:`` only.
"""

import os
import time

import torch
import torch.nn as nn
from spmd.checkpoint.state_dict import (  # port: from torch.distributed.checkpoint.state_dict import (
    _init_optim_state,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    StateDictOptions,
)
from spmd.fsdp import FSDPModule  # port: from torch.distributed.fsdp import FSDPModule
from spmd.tensor import distribute_tensor, DTensor  # port: from torch.distributed.tensor import distribute_tensor, DTensor

MODEL_CHECKPOINT = "model_state_dict.pt"
OPTIM_CHECKPOINT = "optim_state_dict.pt"
PARAMS = "params"


def get_latest_checkpoint_folder(path):
    """The largest numeric folder name under ``path`` (the folders are save times in ms), or None."""
    if not os.path.exists(path):
        return None
    numbers = [int(name) for name in os.listdir(path) if name.isdigit() and os.path.isdir(os.path.join(path, name))]
    return max(numbers, default=None)


class Checkpointer:
    def __init__(self, folder: str, dcp_api: bool):
        self.folder = folder
        self.dcp_api = dcp_api
        self.last_training_time = get_latest_checkpoint_folder(self._root())

    def _root(self):
        return f"{self.folder}/{'dcp_api' if self.dcp_api else 'dtensor_api'}"

    def is_empty(self):
        return self.last_training_time is None

    def _load(self, name):
        return torch.load(f"{self._root()}/{self.last_training_time}/{name}", mmap=True, weights_only=True, map_location="cpu")

    def load_model(self, model: FSDPModule):
        full_sd = self._load(MODEL_CHECKPOINT)
        if self.dcp_api:
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            set_model_state_dict(model=model, model_state_dict=full_sd, options=options)
            return
        # by hand: each full tensor distributed like the (meta) sharded parameter it replaces
        meta_sharded_sd = model.state_dict()
        sharded_sd = {}
        for name, full_tensor in full_sd.items():
            meta_param = meta_sharded_sd.get(name)
            sharded = distribute_tensor(full_tensor, meta_param.device_mesh, meta_param.placements)
            sharded_sd[name] = nn.Parameter(sharded)
        # assign=True: the parameters may still be on the meta device, which copy_ cannot write
        model.load_state_dict(sharded_sd, strict=False, assign=True)

    def load_optim(self, model: FSDPModule, opt: torch.optim.Optimizer):
        full_sd = self._load(OPTIM_CHECKPOINT)
        if self.dcp_api:
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            set_optimizer_state_dict(model=model, optimizers=opt, optim_state_dict=full_sd, options=options)
            return
        _init_optim_state(opt)  # the optimizer's (sharded) state exists now: fill it from the full one
        param_groups = opt.state_dict()["param_groups"]
        state = opt.state_dict()["state"]
        for group, full_group in zip(param_groups, full_sd["param_groups"]):
            group.update({k: v for k, v in full_group.items() if k != PARAMS})
            for pid, full_pid in zip(group[PARAMS], full_group[PARAMS]):
                if pid not in state:
                    continue
                for attr, full_tensor in full_sd["state"][full_pid].items():
                    sharded = state[pid][attr]
                    if isinstance(sharded, DTensor):  # exp_avg, exp_avg_sq
                        state[pid][attr] = distribute_tensor(full_tensor, sharded.device_mesh, sharded.placements)
                    else:  # step: a plain tensor
                        state[pid][attr] = full_tensor
        opt.load_state_dict({"param_groups": param_groups, "state": state})

    def _get_full_model_state_dict(self, model: FSDPModule):
        if self.dcp_api:
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            return get_model_state_dict(model=model, options=options)
        cpu_state_dict = {}
        for name, sharded in model.state_dict().items():
            full = sharded.full_tensor()  # a collective: every rank takes part
            if torch.distributed.get_rank() == 0:
                cpu_state_dict[name] = full.cpu()
        return cpu_state_dict

    def _get_full_optimizer_state_dict(self, model: FSDPModule, opt: torch.optim.Optimizer):
        if self.dcp_api:
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            return get_optimizer_state_dict(model=model, optimizers=opt, options=options)
        is_rank_zero = torch.distributed.get_rank() == 0
        sharded_sd = opt.state_dict()
        full_state = {}
        for pid, sharded_group in sharded_sd["state"].items():
            group_state = {}
            for attr, sharded in sharded_group.items():
                full = sharded.full_tensor() if isinstance(sharded, DTensor) else sharded  # step is plain
                if is_rank_zero:
                    group_state[attr] = full.cpu()
            if is_rank_zero:
                full_state[pid] = group_state
        return {"param_groups": sharded_sd["param_groups"], "state": full_state} if is_rank_zero else {}

    def save(self, model: FSDPModule, optim: torch.optim.Optimizer):
        model_state_dict = self._get_full_model_state_dict(model)
        optim_state_dict = self._get_full_optimizer_state_dict(model, optim)
        if torch.distributed.get_rank() == 0:
            folder = f"{self._root()}/{int(time.time() * 1000)}"
            os.makedirs(folder, exist_ok=True)
            torch.save(model_state_dict, f"{folder}/{MODEL_CHECKPOINT}")
            torch.save(optim_state_dict, f"{folder}/{OPTIM_CHECKPOINT}")
