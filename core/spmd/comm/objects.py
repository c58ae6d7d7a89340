"""Object collectives: any picklable Python object, carried as uint8 tensors.

They unpickle what peers send, so use them only between trusted ranks of
your own job, exactly as with torch.distributed.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from spmd.comm import collectives, p2p
from spmd.comm.checks import give_up, resolve_root
from spmd.comm.group import ProcessGroup
from spmd.comm.state import resolve_group


def _to_tensor(obj: Any) -> torch.Tensor:
    buffer = io.BytesIO()
    pickle.dump(obj, buffer)
    return torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)


def _from_tensor(data: torch.Tensor) -> Any:
    return pickle.loads(data.numpy().tobytes())


def transport_device(g: ProcessGroup, device: torch.device | str | None = None) -> torch.device:
    """Where the pickled bytes travel: ``device`` if given; the CPU if the group has a CPU backend;
    else, as torch does for NCCL, the current device of the group's first device type."""
    if device is not None:
        return torch.device(device)
    if g.backend_map is None or "cpu" in g.backend_map:
        return torch.device("cpu")
    kind = next(iter(g.backend_map))
    return torch.device(kind, torch.get_device_module(kind).current_device())


def _padded_payload(g: ProcessGroup, obj: Any, where: torch.device) -> tuple[list[int], torch.Tensor]:
    """Every rank's pickled size (gathered), and ``obj`` pickled and zero-padded to the longest."""
    payload = _to_tensor(obj)
    local = torch.tensor([payload.numel()], dtype=torch.int64, device=where)
    gathered = torch.empty(g.size, dtype=torch.int64, device=where)
    collectives.all_gather_into_tensor(gathered, local, group=g)
    sizes = gathered.tolist()
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=where)
    padded[: payload.numel()] = payload.to(where)
    return sizes, padded


def all_gather_object(object_list: list[Any], obj: Any, group: ProcessGroup | None = None) -> None:
    """``object_list[r]`` becomes rank r's ``obj`` on every rank."""
    try:
        g = resolve_group(group)
        if len(object_list) != g.size:
            raise ValueError(f"all_gather_object: object_list has {len(object_list)} slots but the group has {g.size} ranks")
        where = transport_device(g)
        sizes, padded = _padded_payload(g, obj, where)
        longest = padded.numel()
        gathered = torch.empty(longest * g.size, dtype=torch.uint8, device=where)
        collectives.all_gather_into_tensor(gathered, padded, group=g)
        for r, block in enumerate(gathered.cpu().view(g.size, longest)):
            object_list[r] = _from_tensor(block[: sizes[r]])
    except Exception as error:
        give_up(group, "all_gather_object", error)
        raise


def broadcast_object_list(
    object_list: list[Any],
    src: int | None = None,
    group: ProcessGroup | None = None,
    device: torch.device | str | None = None,
    group_src: int | None = None,
) -> None:
    """Every rank's ``object_list`` becomes ``src``'s (lists must have equal length).

    ``device``, as in torch, is where the pickled bytes travel; by default
    ``transport_device`` picks it from the group's backends.
    """
    try:
        g = resolve_group(group)
        root = resolve_root(g, 0 if src is None and group_src is None else src, group_src, "src", "broadcast_object_list")
        where = transport_device(g, device)
        payload = _to_tensor(list(object_list)).to(where) if g.rank == root else torch.empty(0, dtype=torch.uint8, device=where)
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=where)
        collectives.broadcast(size, group=g, group_src=root)
        if g.rank != root:
            payload = torch.empty(int(size.item()), dtype=torch.uint8, device=where)
        collectives.broadcast(payload, group=g, group_src=root)
        if g.rank != root:
            received = _from_tensor(payload.cpu())
            if len(received) != len(object_list):
                raise ValueError(
                    f"broadcast_object_list: this rank's list has {len(object_list)} slots but the "
                    f"source sent {len(received)}; give every rank a list of the same length"
                )
            object_list[:] = received
    except Exception as error:
        give_up(group, "broadcast_object_list", error)
        raise


def gather_object(obj: Any, object_gather_list: list[Any] | None = None, dst: int | None = None, group: ProcessGroup | None = None, group_dst: int | None = None) -> None:
    """On ``dst``, ``object_gather_list[r]`` becomes rank r's ``obj``."""
    try:
        g = resolve_group(group)
        root = resolve_root(g, 0 if dst is None and group_dst is None else dst, group_dst, "dst", "gather_object")
        if g.rank == root and (object_gather_list is None or len(object_gather_list) != g.size):
            raise ValueError(f"gather_object: the destination must pass object_gather_list with {g.size} slots")
        where = transport_device(g)
        sizes, padded = _padded_payload(g, obj, where)
        longest = padded.numel()
        slots = [torch.empty(longest, dtype=torch.uint8, device=where) for _ in range(g.size)] if g.rank == root else None
        collectives.gather(padded, slots, group=g, group_dst=root)
        if slots is not None and object_gather_list is not None:
            for r, block in enumerate(slots):
                object_gather_list[r] = _from_tensor(block[: sizes[r]].cpu())
    except Exception as error:
        give_up(group, "gather_object", error)
        raise


def scatter_object_list(scatter_object_output_list: list[Any], scatter_object_input_list: list[Any] | None = None, src: int | None = None, group: ProcessGroup | None = None, group_src: int | None = None) -> None:
    """``scatter_object_output_list[0]`` becomes ``src``'s ``scatter_object_input_list[r]`` on rank r."""
    try:
        g = resolve_group(group)
        root = resolve_root(g, 0 if src is None and group_src is None else src, group_src, "src", "scatter_object_list")
        if not scatter_object_output_list:
            raise ValueError("scatter_object_list: pass an output list with at least one slot")
        payloads = None
        if g.rank == root:
            if scatter_object_input_list is None or len(scatter_object_input_list) != g.size:
                raise ValueError(f"scatter_object_list: the source must pass {g.size} objects, one per rank")
            payloads = [_to_tensor(o) for o in scatter_object_input_list]
        where = transport_device(g)
        sizes = torch.tensor([p.numel() for p in payloads] if payloads else [0] * g.size, dtype=torch.int64, device=where)
        collectives.broadcast(sizes, group=g, group_src=root)
        counts = sizes.tolist()
        longest = max(counts)
        padded = None
        if payloads is not None:
            padded = [torch.zeros(longest, dtype=torch.uint8, device=where) for _ in payloads]
            for slot, p in zip(padded, payloads):
                slot[: p.numel()] = p.to(where)
        mine = torch.empty(longest, dtype=torch.uint8, device=where)
        collectives.scatter(mine, padded, group=g, group_src=root)
        scatter_object_output_list[0] = _from_tensor(mine[: counts[g.rank]].cpu())
    except Exception as error:
        give_up(group, "scatter_object_list", error)
        raise


def send_object_list(
    object_list: list[Any],
    dst: int | None = None,
    group: ProcessGroup | None = None,
    device: torch.device | str | None = None,
    group_dst: int | None = None,
    use_batch: bool = False,
) -> None:
    """Send ``object_list`` (pickled) to ``dst``, which calls ``recv_object_list``.

    ``use_batch`` is taken for torch's signature: in torch it only changes how
    NCCL sets up its communicators, and the objects arrive the same either way.
    """
    g = resolve_group(group)
    peer = resolve_root(g, dst, group_dst, "dst", "send_object_list")
    where = transport_device(g, device)
    payload = _to_tensor(list(object_list)).to(where)
    p2p.send(torch.tensor([payload.numel()], dtype=torch.int64, device=where), group=g, group_dst=peer)
    p2p.send(payload, group=g, group_dst=peer)


def recv_object_list(
    object_list: list[Any],
    src: int | None = None,
    group: ProcessGroup | None = None,
    device: torch.device | str | None = None,
    group_src: int | None = None,
    use_batch: bool = False,
) -> int:
    """Fill ``object_list`` with what ``src`` sent by ``send_object_list``; returns the sender's global rank."""
    g = resolve_group(group)
    peer = resolve_root(g, src, group_src, "src", "recv_object_list")
    where = transport_device(g, device)
    size = torch.empty(1, dtype=torch.int64, device=where)
    p2p.recv(size, group=g, group_src=peer)
    payload = torch.empty(int(size.item()), dtype=torch.uint8, device=where)
    p2p.recv(payload, group=g, group_src=peer)
    received = _from_tensor(payload.cpu())
    if len(received) != len(object_list):
        raise ValueError(
            f"recv_object_list: this rank's list has {len(object_list)} slots but rank {g.ranks[peer]} sent "
            f"{len(received)}; give both sides lists of the same length"
        )
    object_list[:] = received
    return g.ranks[peer]
