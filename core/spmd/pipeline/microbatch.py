"""Microbatch splitting and merging, with torch.distributed.pipelining's conventions."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def split(tensor: torch.Tensor, n_microbatches: int, what: str) -> list[torch.Tensor]:
    """``torch.tensor_split(tensor, n, dim=0)``: the first ``len % n`` microbatches are one row longer.

    torch's pipelining splits the same way; unlike torch, spmd accepts a
    batch that the microbatch count does not divide (microbatches then differ
    by one row, and the average of per-microbatch mean losses weights the
    short ones slightly more than one mean over the batch would).
    """
    if tensor.dim() == 0 or tensor.shape[0] < n_microbatches:
        rows = tensor.shape[0] if tensor.dim() else 0
        raise ValueError(f"pipeline step: {what} has {rows} rows, fewer than the {n_microbatches} microbatches")
    return list(torch.tensor_split(tensor, n_microbatches, dim=0))


def merge(chunks: Sequence[torch.Tensor]) -> torch.Tensor:
    """The last stage's outputs of every microbatch, concatenated along dim 0 (torch's default merge)."""
    return torch.cat(list(chunks), dim=0)
