"""The one-process reference for examples/ports/fsdp_tp_example.py: the same model, init, data and optimizer,
no parallelism, each step on the full batch (every data-parallel rank's sequences at once).

    PYTHONPATH=examples/ports python tests/tp_ports_reference.py [dp_size]

prints ``{"losses": [[dp rank 0's loss per step], [dp rank 1's], ...]}``: each data-parallel rank's share of
the full batch, scored after the same forward. FSDP averages the gradients over the data-parallel ranks; with
the mean cross-entropy and equal shares that is the full batch's gradient, so a 2-D run's rank with dp rank
``d`` must print the reference's ``losses[d]``. A separate process keeps the example's modules (and its
logging setup) out of pytest's.
"""

from __future__ import annotations

import json
import sys

import torch


def reference_losses(dp_size: int) -> list[list[float]]:
    """Per data-parallel rank, per step: its loss on its share of the full batch in the one-process run."""
    import fsdp_tp_example as ex

    model = ex.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=ex.LR, foreach=True)
    losses: list[list[float]] = [[] for _ in range(dp_size)]
    for i in range(ex.NUM_ITERATIONS):
        batches = [ex.get_batch(i, d) for d in range(dp_size)]
        output = model(torch.cat([inp for inp, _ in batches]))
        shares = [ex.loss_fn(out, labels) for out, (_, labels) in zip(output.chunk(dp_size), batches, strict=True)]
        loss = torch.stack(shares).mean()  # = the full batch's mean cross-entropy (equal shares)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        for d, share in enumerate(shares):
            losses[d].append(share.item())
    return losses


if __name__ == "__main__":
    print(json.dumps({"losses": reference_losses(int(sys.argv[1]) if len(sys.argv) > 1 else 2)}))
