"""Run examples/train.py on a Ray cluster: N Ray workers, one rank each (spmd.integrations.ray).

    python examples/train_ray.py --workers 2 -- --steps 100        # a local Ray cluster, or the one at RAY_ADDRESS
    python examples/train_ray.py --workers 8 --max-restarts 2 -- --save-every 50 --checkpoint-dir /shared/ckpt --resume

Arguments after ``--`` go to train.py unchanged. With ``--max-restarts`` a
worker that fails or dies restarts the whole group on new workers, and
train.py's ``--resume`` continues from the last checkpoint (on storage every
node sees).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

EXAMPLES = os.path.dirname(os.path.abspath(__file__))


def train_fn(config: dict[str, Any]) -> dict[str, object]:
    """One Ray worker's rank: train.py's main with ``config["argv"]``."""
    if config["examples"] not in sys.path:  # train.py imports its neighbours (model, checkpointing)
        sys.path.insert(0, config["examples"])
    import train

    return train.main(list(config["argv"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2, help="Ray workers (ranks), one CPU each")
    parser.add_argument("--backend", default=None, help="spmd backend, e.g. gloo (default: the best installed)")
    parser.add_argument("--max-restarts", type=int, default=0, help="restarts of the whole group after a failure")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then train.py's arguments")
    args = parser.parse_args()
    from spmd.integrations import ray as spmd_ray

    argv = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    results = spmd_ray.run(train_fn, {"argv": argv, "examples": EXAMPLES}, num_workers=args.workers,
                           backend=args.backend, max_restarts=args.max_restarts)
    losses = results[0]["losses"]
    assert isinstance(losses, dict)
    if losses:
        last = max(losses)
        print(f"ray: {len(results)} workers done; rank 0's last loss {losses[last]:.4f} at step {last}, "
              f"validation loss {results[0]['validation_loss']:.3f}")


if __name__ == "__main__":
    main()
