"""Distributed checkpoints: parallel save, reshard on load, async save, no pickle, storage plugins.

    import spmd.checkpoint as dcp

    dcp.save({"model": model.state_dict(), "step": 10}, checkpoint_id="ckpt/10")   # every rank
    state = {"model": model.state_dict(), "step": 0}
    dcp.load(state, checkpoint_id="ckpt/10")            # in place, resharded to the current placements

Tensors go to ``.safetensors`` files (one per writing rank), the layout and
the non-tensor values to ``metadata.json``, written last and atomically.
Storages are plugins (``spmd_storages``); local paths and ``file://`` are builtin.
"""

from spmd.checkpoint.async_save import SaveFuture, async_save
from spmd.checkpoint.load import load
from spmd.checkpoint.metadata import CheckpointError, Metadata
from spmd.checkpoint.save import save
from spmd.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from spmd.checkpoint.storage import Storage, StorageNotFoundError, StorageSpec, open_storage

__all__ = [
    "CheckpointError",
    "Metadata",
    "SaveFuture",
    "StateDictOptions",
    "Storage",
    "StorageNotFoundError",
    "StorageSpec",
    "async_save",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
    "load",
    "open_storage",
    "save",
]
