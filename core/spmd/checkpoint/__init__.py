"""Distributed checkpoints: parallel save, reshard on load, async save, no pickle, storage plugins.

    import spmd.checkpoint as dcp

    dcp.save({"model": model.state_dict(), "step": 10}, checkpoint_id="ckpt/10")   # every rank
    state = {"model": model.state_dict(), "step": 0}
    dcp.load(state, checkpoint_id="ckpt/10")            # in place, resharded to the current placements

Tensors go to ``.safetensors`` files (one per writing rank), the layout and
the non-tensor values to ``metadata.json``, written last and atomically.
Storages are plugins (``spmd_storages``); local paths and ``file://`` are builtin.

Mirrors ``torch.distributed.checkpoint`` (and ``.state_dict``, ``.stateful``):
torch's names spmd lacks raise ``NotYetInSpmdError`` with the closest spmd way.
"""

from spmd._mirror import missing_names
from spmd.checkpoint.async_save import SaveFuture, async_save
from spmd.checkpoint.claim import CheckpointInUseError
from spmd.checkpoint.filesystem import FileSystemReader, FileSystemWriter
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
from spmd.checkpoint.stateful import Stateful
from spmd.checkpoint.storage import Storage, StorageNotFoundError, StorageSpec, open_storage

#: torch's name for the error a failed save or load raises.
CheckpointException = CheckpointError

__all__ = [
    "CheckpointError",
    "CheckpointException",
    "CheckpointInUseError",
    "FileSystemReader",
    "FileSystemWriter",
    "Metadata",
    "SaveFuture",
    "StateDictOptions",
    "Stateful",
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

_PLANNER = (
    "leave planner= out: spmd plans reads and writes itself (a replicated chunk is written once, the writes spread "
    "over the ranks that hold it; spmd.checkpoint.planner), and custom planners are not pluggable yet"
)
_STORAGE = "a storage plugin: subclass spmd.checkpoint.Storage and return a StorageSpec from an spmd_storages hook (docs/checkpoint.md)"
_METADATA = "spmd.checkpoint.Metadata: metadata.tensors[key] (shape, dtype, chunks) and metadata.values (JSON values)"
_HF = (
    "spmd's own format is safetensors already (one file per writing rank, layout in metadata.json); "
    "`spmd checkpoint consolidate` writes one full file"
)

#: torch.distributed.checkpoint names spmd does not have yet -> the closest spmd way.
MISSING = {
    "DefaultSavePlanner": _PLANNER,
    "DefaultLoadPlanner": _PLANNER,
    "SavePlanner": _PLANNER,
    "LoadPlanner": _PLANNER,
    "SavePlan": _PLANNER,
    "LoadPlan": _PLANNER,
    "ReadItem": _PLANNER,
    "WriteItem": _PLANNER,
    "StorageReader": _STORAGE,
    "StorageWriter": _STORAGE,
    "BytesStorageMetadata": _METADATA,
    "ChunkStorageMetadata": _METADATA,
    "TensorStorageMetadata": _METADATA,
    "HuggingFaceStorageReader": _HF,
    "HuggingFaceStorageWriter": _HF,
    "QuantizedHuggingFaceStorageReader": _HF,
    "load_sharded_optimizer_state_dict": "spmd.checkpoint.state_dict.get_optimizer_state_dict(model, optim) then "
    "spmd.checkpoint.load(...) into it (it reshards on load) and set_optimizer_state_dict",
    "save_state_dict": "spmd.checkpoint.save(state_dict, checkpoint_id=path) (torch's replacement of this deprecated name)",
    "load_state_dict": "spmd.checkpoint.load(state_dict, checkpoint_id=path) (torch's replacement of this deprecated name)",
}

__getattr__ = missing_names(__name__, MISSING)
