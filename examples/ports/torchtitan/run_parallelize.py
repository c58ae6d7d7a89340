"""torchtitan's ``apply_tp`` / ``apply_fsdp`` (parallelize_llama.py) on its Llama 3 debug model, on CPU: one
forward and one backward, printing the loss and the norms of a few full gradients.

    spmd run --nproc-per-node 2 examples/ports/torchtitan/run_parallelize.py --mode tp     # or: torchrun ...
    spmd run --nproc-per-node 2 examples/ports/torchtitan/run_parallelize.py --mode fsdp
    spmd run --nproc-per-node 4 examples/ports/torchtitan/run_parallelize.py --mode tp_fsdp   # (dp, tp) = (2, 2)
    python examples/ports/torchtitan/run_parallelize.py --mode none                        # one process, no parallelism

The model is torchtitan's "debugmodel" (dim 256, 8 layers, 16 heads, the test tokenizer's 2256 words) in float32,
built with one seed on every rank and then parallelized as torchtitan does: ``apply_tp`` on the "tp" mesh
(loss_parallel off, no float8, no async TP), ``apply_fsdp`` on the "dp" mesh (float32 param and reduce dtypes,
no pipeline parallelism). Every data-parallel rank takes its share of one fixed batch; the loss is the mean
next-token cross-entropy, averaged over the data-parallel ranks (= the full batch's, as the shares are equal),
and FSDP's averaged gradients are the full batch's, so every mode prints what the one-process run prints.
Each rank prints one ``RESULT {json}`` line. The lines marked ``# port:`` are the only ones that differ
from the torch version.
"""

import argparse
import json
import math
import os

import torch
import torch.nn.functional as F
from model import DEBUG_MODEL_ARGS, Transformer, TransformerModelArgs
from parallelize_llama import apply_fsdp, apply_tp

# isort: off
import spmd as dist  # port: import torch.distributed as dist
from spmd.device_mesh import init_device_mesh  # port: from torch.distributed.device_mesh import init_device_mesh
from spmd.tensor import DTensor  # port: from torch.distributed.tensor import DTensor
# isort: on

VOCAB_SIZE = 2256  # torchtitan's tests/assets/test_tiktoken.model: 2000 words + 256 special tokens
BATCH_SIZE = 4  # sequences in the whole batch, split over the data-parallel ranks
SEQ_LEN = 32
#: the gradients whose norms are printed (and "total", over every parameter)
REPORTED = (
    "tok_embeddings.weight",
    "layers.0.attention_norm.weight",
    "layers.0.attention.wq.weight",
    "layers.3.attention.wo.weight",
    "layers.7.feed_forward.w2.weight",
    "norm.weight",
    "output.weight",
)


def build_model() -> Transformer:
    """The debug model, seeded: the same weights on every rank and in the one-process run."""
    torch.manual_seed(0)
    return Transformer(TransformerModelArgs(**DEBUG_MODEL_ARGS, vocab_size=VOCAB_SIZE, max_seq_len=SEQ_LEN))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed batch: tokens and next-token labels."""
    tokens = torch.randint(VOCAB_SIZE, (BATCH_SIZE, SEQ_LEN + 1), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


def full_grad(param: torch.Tensor) -> torch.Tensor:
    grad = param.grad
    return grad.full_tensor() if isinstance(grad, DTensor) else grad


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("none", "tp", "fsdp", "tp_fsdp"), required=True)
    mode = parser.parse_args().mode

    model = build_model()
    rank, dp_rank, dp_size, dp_group = 0, 0, 1, None
    if mode != "none":
        world = int(os.environ["WORLD_SIZE"])
        tp_size = 2 if mode in ("tp", "tp_fsdp") else 1
        mesh = init_device_mesh("cpu", (world // tp_size, tp_size), mesh_dim_names=("dp", "tp"))
        rank = dist.get_rank()
        if tp_size > 1:
            apply_tp(model, mesh["tp"], loss_parallel=False, enable_float8_tensorwise_tp=False, enable_async_tp=False)
        if mode != "tp":
            apply_fsdp(model, mesh["dp"], param_dtype=torch.float32, reduce_dtype=torch.float32, pp_enabled=False)
            dp_rank, dp_size, dp_group = mesh.get_local_rank("dp"), mesh["dp"].size(), mesh.get_group("dp")

    inputs, labels = (t.chunk(dp_size)[dp_rank] for t in batch())
    output = model(inputs)
    loss = F.cross_entropy(output.flatten(0, 1), labels.flatten())
    loss.backward()

    reported = loss.detach().clone()
    if dp_size > 1:
        dist.all_reduce(reported, group=dp_group)
        reported /= dp_size
    params = dict(model.named_parameters())
    grads = {name: full_grad(p) for name, p in params.items()}
    row = {
        "rank": rank,
        "mode": mode,
        # how the parallelism laid the parameters out: how many are DTensors, and one weight's local shard
        "dtensor_params": sum(isinstance(p, DTensor) for p in params.values()),
        "wq_local_shape": list(local(params["layers.0.attention.wq.weight"]).shape),
        "loss": reported.item(),
        "grad_norms": {name: grads[name].norm().item() for name in REPORTED},
        "total_grad_norm": math.sqrt(sum(g.double().pow(2).sum().item() for g in grads.values())),
    }
    print("RESULT " + json.dumps(row), flush=True)
    if mode != "none":
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
