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
            conn.send(("ok", result))


if __name__ == "__main__":
    main(sys.argv[1:])
