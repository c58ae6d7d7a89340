# ruff: noqa: I001  (the ported import lines carry their torch original as a trailing comment)
"""pytorch/examples' distributed/FSDP2/example.py on the CPU: a toy transformer built on the meta device,
``fully_shard`` per block then the root, ``to_empty`` + ``reset_parameters`` (or a checkpoint loaded),
Adam with gradient clipping, optional bf16 ``MixedPrecisionPolicy`` and explicit prefetching, and a
checkpoint saved at the end (fsdp2_checkpoint.py).

    spmd run --nproc-per-node 2 examples/ports/fsdp2_example.py [--mixed-precision] [--explicit-prefetching] [--dcp-api]

Ported from torch.distributed by changing the lines marked ``# port:`` only (here and in fsdp2_checkpoint.py,
fsdp2_utils.py). As in the original, ``torch.distributed.init_process_group``/``get_rank`` are called through
``import torch``: not import lines, so they stay torch's and spmd joins the world torch made.

CPU adaptation and test hooks (not in the original): the device is the CPU (Gloo; no ``device_id=``, which
torch takes for an accelerator only), the model is tiny,
``--steps``/``--ckpt-dir`` set the number of steps and the checkpoint folder, and batch ``i`` is drawn after
``torch.manual_seed(i)`` with ``i`` the global step (Adam's step count after a load), so that a resumed run sees
the batches an uninterrupted one would. Each rank prints ``RESULT {json}``: its losses and a digest of the final
full state dict.
"""

import argparse
import hashlib
import json
import os

import torch
from fsdp2_checkpoint import Checkpointer
from fsdp2_model import ModelArgs, Transformer
from spmd.fsdp import fully_shard, MixedPrecisionPolicy  # port: from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy
from fsdp2_utils import inspect_mixed_precision, inspect_model


def set_modules_to_forward_prefetch(model, num_to_forward_prefetch):
    for i, layer in enumerate(model.layers):
        if i >= len(model.layers) - num_to_forward_prefetch:
            break
        layer.set_modules_to_forward_prefetch([model.layers[i + j] for j in range(1, num_to_forward_prefetch + 1)])


def set_modules_to_backward_prefetch(model, num_to_backward_prefetch):
    for i, layer in enumerate(model.layers):
        if i < num_to_backward_prefetch:
            continue
        layer.set_modules_to_backward_prefetch([model.layers[i - j] for j in range(1, num_to_backward_prefetch + 1)])


def digest(model):
    """The full state dict (a collective) as sums and a hash of its bytes, taken on every rank."""
    full = {name: t.full_tensor().detach().float() for name, t in model.state_dict().items()}
    sha = hashlib.sha256()
    for name in sorted(full):
        sha.update(name.encode())
        sha.update(full[name].contiguous().numpy().tobytes())
    return {
        "sum": sum(float(t.sum()) for t in full.values()),
        "sq": sum(float(t.pow(2).sum()) for t in full.values()),
        "sha": sha.hexdigest(),
    }


def main(args):
    rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cpu")
    print(f"Running on rank {rank} on device {device}")
    backend = torch.distributed.get_default_backend_for_device(device)
    torch.distributed.init_process_group(backend=backend)  # device_id=: an accelerator only

    torch.manual_seed(0)
    vocab_size = 96
    batch_size = 4
    seq_len = 16
    model_args = ModelArgs(n_layers=2, n_heads=4, vocab_size=vocab_size, max_seq_len=seq_len, dim=32, dropout_p=0)
    with torch.device("meta"):
        model = Transformer(model_args)
    fsdp_kwargs = {}
    if args.mixed_precision:
        fsdp_kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)

    inspect_model(model)

    if args.explicit_prefetching:
        set_modules_to_forward_prefetch(model, num_to_forward_prefetch=2)
        set_modules_to_backward_prefetch(model, num_to_backward_prefetch=2)

    checkpointer = Checkpointer(args.ckpt_dir, dcp_api=args.dcp_api)
    if checkpointer.last_training_time is None:
        model.to_empty(device=device)
        model.reset_parameters()
    else:
        checkpointer.load_model(model)

    if args.mixed_precision:
        inspect_mixed_precision(model)

    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    if checkpointer.last_training_time is not None:
        checkpointer.load_optim(model, optim)
    start = int(max((float(s["step"]) for s in optim.state.values()), default=0))
    initial = digest(model)

    losses = []
    for step in range(start, start + args.steps):
        if args.explicit_prefetching:
            model.unshard()
        torch.manual_seed(step)
        x = torch.randint(0, vocab_size, (batch_size, seq_len), device=device)
        loss = model(x).sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())

    checkpointer.save(model, optim)
    row = {
        "rank": torch.distributed.get_rank(),
        "lib": fully_shard.__module__.split(".")[0],
        "resumed": checkpointer.last_training_time is not None,
        "start": start,
        "losses": losses,
        "initial": initial,
        "final": digest(model),
    }
    print("RESULT " + json.dumps(row), flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="PyTorch FSDP2 example")
    parser.add_argument("--explicit-prefetching", action="store_true", default=False)
    parser.add_argument("--mixed-precision", action="store_true", default=False)
    parser.add_argument("--dcp-api", action="store_true", default=False)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--ckpt-dir", default="checkpoints")
    args = parser.parse_args()
    main(args)
