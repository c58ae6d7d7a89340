"""Logging helpers of pytorch/examples' distributed/tensor_parallelism/log_utils.py, for CPU.

The tensor-parallel ports import ``rank_log`` and ``get_logger`` from here as
the originals do. The originals' ``verify_min_gpu_count`` guard is left out:
these ports run on CPU with gloo. Log lines go to stderr, so a script's
``RESULT`` rows are the only thing on stdout.
"""

import logging

logging.basicConfig(format="%(asctime)s %(message)s", datefmt="%m/%d/%Y %I:%M:%S %p", level=logging.INFO)


def get_logger() -> logging.Logger:
    """The examples' shared logger."""
    return logging.getLogger(__name__)


def rank_log(_rank: int, logger: logging.Logger, msg: str) -> None:
    """Log ``msg`` on global rank 0 only (the other ranks would repeat it)."""
    if _rank == 0:
        logger.info(f" {msg}")
