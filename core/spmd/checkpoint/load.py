"""``load``: each rank reads, for the mesh and placements it has now, only the byte ranges it needs.

No collective is used: every rank reads ``metadata.json`` and the spans of
the stored chunks that overlap its own shard, so ``load`` works in any world
size, on any mesh, and in one process without ``spmd.init``.
"""

from __future__ import annotations

import math
import os
from collections.abc import MutableMapping
from typing import Any

import torch

from spmd.checkpoint.datafiles import DataFiles
from spmd.checkpoint.flatten import leaves, restore_value
from spmd.checkpoint.metadata import (
    METADATA_FILE,
    CheckpointError,
    Metadata,
    TensorEntry,
    is_data_dir,
)
from spmd.checkpoint.pending import wait_pending
from spmd.checkpoint.planner import Box, covered, is_contiguous_box, plan_reads, span
from spmd.checkpoint.safetensors_io import byte_view, tensor_from
from spmd.checkpoint.schema import MAX_METADATA_BYTES, parse_metadata
from spmd.checkpoint.stateful import expand_stateful, restore_stateful
from spmd.checkpoint.storage import Storage, checkpoint_location, open_storage


def read_metadata(storage: Storage, checkpoint_id: str) -> Metadata:
    """The committed metadata, validated, or an error that says whether the checkpoint is missing, partial or damaged."""
    if not storage.exists(METADATA_FILE):
        partial = [n for n in storage.listdir() if is_data_dir(n)]
        if partial:
            raise CheckpointError(
                f"checkpoint {checkpoint_id!r} is partial: it has data ({', '.join(partial)}) but no {METADATA_FILE}, "
                "so no save there ever finished; load an earlier checkpoint"
            )
        raise CheckpointError(f"no checkpoint at {checkpoint_id!r} ({METADATA_FILE} not found)")
    where = f"{checkpoint_id}/{METADATA_FILE}"
    size = storage.size(METADATA_FILE)
    if size > MAX_METADATA_BYTES:
        raise CheckpointError(f"{where} is {size} bytes, more than the {MAX_METADATA_BYTES} a checkpoint's metadata "
                              "may have; it is damaged or not an spmd checkpoint")
    return parse_metadata(storage.read(METADATA_FILE, 0, size), where)


def _target(tensor: torch.Tensor) -> tuple[torch.Tensor, Box | None]:
    """The local tensor to fill and its box in the global tensor (None: this rank holds a zero summand)."""
    from spmd.tensor.dtensor import DTensor
    from spmd.tensor.spec import holds_zero_summand, local_shape_and_offset

    if not isinstance(tensor, DTensor):
        return tensor, ((0,) * tensor.ndim, tuple(tensor.shape))
    spec = tensor._spec
    local = tensor._local_tensor
    coordinate = spec.mesh.get_coordinate()
    if coordinate is None:
        return local, ((0,) * local.ndim, (0,) * local.ndim)
    if holds_zero_summand(spec, coordinate):
        return local, None  # Partial("sum"): the first rank along the dimension holds the value, the others zero
    sizes, offsets = local_shape_and_offset(spec.shape, spec.mesh, spec.placements)
    return local, (offsets, sizes)


def read_box(files: DataFiles, key: str, entry: TensorEntry, box: Box, out: torch.Tensor | None = None) -> torch.Tensor:
    """Fill ``out`` (or a new tensor) with ``box`` of the stored tensor ``key``, reading only the spans it needs.

    Every file read from is checked against the metadata first, before ``out`` is allocated.
    """
    dtype = entry.torch_dtype
    steps = plan_reads(box, entry.chunks)
    if not covered(box, steps):
        raise CheckpointError(f"checkpoint entry {key!r} does not cover the region {box} it claims; it is damaged")
    for step in steps:
        files.check(entry, step.chunk)
    storage = files.storage
    if out is None:
        out = torch.empty(box[1], dtype=dtype)
    itemsize = dtype.itemsize
    for step in steps:
        chunk = step.chunk
        first, end = span(chunk.sizes, step.source)
        direct = (
            out.dtype == dtype and out.device.type == "cpu" and out.is_contiguous()
            and is_contiguous_box(chunk.sizes, step.source) and is_contiguous_box(tuple(out.shape), step.target)
        )
        if direct:
            region = out[step.target]
            storage.read_into(chunk.file, chunk.begin + first * itemsize, byte_view(region))
            continue
        raw = storage.read(chunk.file, chunk.begin + first * itemsize, (end - first) * itemsize)
        flat = tensor_from(raw, dtype, (end - first,))
        strides = [math.prod(chunk.sizes[d + 1 :]) for d in range(len(chunk.sizes))]
        piece = flat.as_strided(tuple(s.stop - s.start for s in step.source), strides) if flat.numel() else flat
        out[step.target].copy_(piece.reshape(out[step.target].shape))
    return out


def load(
    state_dict: MutableMapping[str, Any],
    checkpoint_id: str | os.PathLike | None = None,
    *,
    storage_reader: Any = None,
    process_group: Any = None,
) -> None:
    """Fill ``state_dict`` in place from ``checkpoint_id``, resharded to the placements its tensors have now.

    Tensors (DTensor or plain) are overwritten in place, with their current
    placements, whatever the saving job's world size, mesh and placements
    were; a leaf that is not a tensor where the checkpoint holds one becomes
    the full tensor; JSON values replace the old ones. Every key of
    ``state_dict`` must be in the checkpoint. ``process_group`` is accepted
    for torch's signature: a load needs no collective. A top-level
    ``Stateful`` value is loaded as torch's DCP does: its ``state_dict()`` is
    filled in place, then given to its ``load_state_dict``.
    ``storage_reader=FileSystemReader(path)`` is torch's spelling of
    ``checkpoint_id=path``.

        sd = {"model": model.state_dict()}
        spmd.checkpoint.load(sd, checkpoint_id="ckpt/step-100")
    """
    wait_pending()
    checkpoint_id = checkpoint_location(checkpoint_id, storage_reader, "load")
    storage = open_storage(checkpoint_id)
    meta = read_metadata(storage, checkpoint_id)
    files = DataFiles(storage, checkpoint_id)
    expanded = expand_stateful(state_dict)
    missing = []
    for leaf in list(leaves(expanded)):
        entry = meta.tensors.get(leaf.key)
        if entry is not None:
            _load_tensor(files, leaf, entry)
        elif leaf.key in meta.values:
            restore_value(leaf.key, leaf, meta.values[leaf.key])
        else:
            missing.append(leaf.key)
    if missing:
        stored = sorted([*meta.tensors, *meta.values])
        raise CheckpointError(
            f"checkpoint {checkpoint_id!r} has no {missing[:8]}{' ...' if len(missing) > 8 else ''} "
            f"({len(missing)} keys missing); it holds {stored[:8]}{' ...' if len(stored) > 8 else ''}"
        )
    restore_stateful(state_dict, expanded)


def _load_tensor(files: DataFiles, leaf: Any, entry: TensorEntry) -> None:
    value = leaf.value
    if not isinstance(value, torch.Tensor):
        leaf.container[leaf.index] = read_box(files, leaf.key, entry, ((0,) * len(entry.shape), entry.shape))
        return
    if tuple(value.shape) != tuple(entry.shape):
        raise CheckpointError(
            f"state_dict[{leaf.key!r}] has global shape {list(value.shape)} but the checkpoint stores "
            f"{list(entry.shape)}; resharding changes placements, not shapes"
        )
    local, box = _target(value)
    with torch.no_grad():
        if box is None:
            local.zero_()
        elif local.device.type == "cpu" and local.is_contiguous():
            read_box(files, leaf.key, entry, box, out=local)
        else:
            local.copy_(read_box(files, leaf.key, entry, box))
