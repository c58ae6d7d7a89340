"""The worker process of a World: join the job, then run functions until told to exit."""

from __future__ import annotations

import pickle
import sys
import traceback
from datetime import timedelta
from multiprocessing.connection import Client

import torch
import torch.distributed as tdist


def main(argv: list[str]) -> None:
    address, authkey, rank_s, size_s, backend, store_port, timeout_s = argv
    host, port = address.rsplit(":", 1)
    rank, size = int(rank_s), int(size_s)
    if rank < 0:  # started by a job launcher (World(launcher=...)): it says which rank this is
        rank = _launched_rank(size)
    torch.set_num_threads(1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(authkey))
    conn.send(rank)
    try:
        import spmd

        store = tdist.TCPStore(host, int(store_port), size, False, timedelta(seconds=60))
        spmd.init(backend or None, store=store, rank=rank, world_size=size, timeout=float(timeout_s))
        conn.send(("ok", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message[0] == "exit":
            if spmd.is_initialized():
                spmd.destroy_process_group()
            return
        _, payload, path = message
        for entry in path:
            if entry not in sys.path:
                sys.path.append(entry)
        try:
            fn, args, kwargs = pickle.loads(payload)
            result = fn(*args, **kwargs)
        except BaseException:
            conn.send(("error", traceback.format_exc()))
        else:
            # A test that ended with the world group unusable (it provoked a timeout and caught it):
            # the driver retires this world after the test, so the next one starts fresh.
            conn.send(("ok" if _world_usable() else "ok-retire", result))


def _world_usable() -> bool:
    from spmd.comm import state

    current = state._state
    return current is None or current.world.unusable is None


def _launched_rank(size: int) -> int:
    """This process's rank as the launcher that started it announced it (mpiexec, srun, ...)."""
    from spmd.launch.environments import detect_launch

    detected = detect_launch()
    if detected is None:
        raise SystemExit("spmd.testing worker: rank -1 needs a launcher environment, but none was detected")
    name, info = detected
    if info.world_size != size:
        raise SystemExit(f"spmd.testing worker: the {name} launcher started {info.world_size} ranks, the World wants {size}")
    return info.rank


if __name__ == "__main__":
    main(sys.argv[1:])
