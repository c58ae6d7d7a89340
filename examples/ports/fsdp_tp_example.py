"""pytorch/examples' distributed/tensor_parallelism/fsdp_tp_example.py, on CPU: 2-D parallelism of a
Llama-2-style transformer, tensor/sequence parallel ("tp") inside FSDP ("dp").

    spmd run --nproc-per-node 4 examples/ports/fsdp_tp_example.py     # or: torchrun ...

The mesh is (dp, tp) = (world // 2, 2). The plan is the original's: the embedding row-split with its
output sharded on the sequence, the norms SequenceParallel, PrepareModuleInput gathering the sequence
before attention (whose second input, the complex ``freqs_cis``, becomes a replicated DTensor) and
before the feed-forward, wq/wk/wv and w1/w3 column-split, wo and w2 row-split back to a sequence shard,
the output projection column-split with replicated logits; then ``fully_shard`` over "dp".

The lines marked ``# port:`` are the only ones that differ from the torch version. CPU changes against
the original: a small model (``CONFIG``) with a larger learning rate (``LR``), the mesh on "cpu" (no GPU
check), a seeded init, a next-token cross-entropy loss instead of ``output.sum()`` (so the data-parallel
average is the full batch's loss), grads zeroed each step, and every rank prints its per-step losses as one
``RESULT {json}`` line. llama2_model.py writes SDPA out as matmul/softmax (torch's DTensor has no CPU
strategy for it; see ``causal_attention`` there).
``build_model``, ``get_batch`` and ``loss_fn`` are what tests/test_tp_ports.py's one-process
reference reuses.
"""

import json
import os

import torch
import torch.nn.functional as F
from llama2_model import ModelArgs, Transformer
from log_utils import get_logger, rank_log

# the ported lines stay one line each (isort would wrap the long ones and move their '# port:' comments)
# isort: off
import spmd as dist  # port: import torch.distributed as dist
from spmd._tensor import Replicate, Shard  # port: from torch.distributed._tensor import Replicate, Shard
from spmd.device_mesh import init_device_mesh  # port: from torch.distributed.device_mesh import init_device_mesh
from spmd.fsdp import fully_shard  # port: from torch.distributed.fsdp import fully_shard
from spmd.tensor.parallel import (  # port: from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
# isort: on

TP_SIZE = 2
CONFIG = ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=128, multiple_of=32, max_seq_len=16)
#: The original's 3e-3 moves this small model's losses too little for a wrong rotary gradient to show: with the
#: conjugate bit dropped in DTensor dispatch, 1e-2 puts the losses 7e-5 (relative) off after one step, 5e-4 after four.
LR = 1e-2
NUM_ITERATIONS = 5
BATCH_SIZE = 4  # sequences per data-parallel rank
SEQ_LEN = 16


def build_model() -> Transformer:
    """The model every rank (and the reference) starts from: seeded, initialised twice as the original does."""
    torch.manual_seed(0)
    model = Transformer.from_model_args(CONFIG)
    model.init_weights()
    return model


def get_batch(i: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``i``'s tokens and next-token labels for one data-parallel rank (the same on its TP ranks)."""
    torch.manual_seed(i + dp_rank)  # the original seeds with i + dp_rank to mimic a dataloader
    tokens = torch.randint(CONFIG.vocab_size, (BATCH_SIZE, SEQ_LEN + 1))
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of the logits ``output`` (batch, seq, vocab)."""
    return F.cross_entropy(output.flatten(0, 1), labels.flatten())


def parallelize(model: Transformer, tp_mesh, dp_mesh) -> Transformer:
    """The original's TP plan on ``tp_mesh``, then FSDP on ``dp_mesh``."""
    model = parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    for transformer_block in model.layers:
        layer_tp_plan = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1), Replicate()),
                desired_input_layouts=(Replicate(), Replicate()),
            ),
            "attention.wq": ColwiseParallel(use_local_output=False),
            "attention.wk": ColwiseParallel(use_local_output=False),
            "attention.wv": ColwiseParallel(use_local_output=False),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(
                input_layouts=(Shard(1),),
                desired_input_layouts=(Replicate(),),
            ),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        }
        parallelize_module(module=transformer_block, device_mesh=tp_mesh, parallelize_plan=layer_tp_plan)
    return fully_shard(model, mesh=dp_mesh)


def main():
    logger = get_logger()
    _rank = int(os.environ["RANK"])
    _world_size = int(os.environ["WORLD_SIZE"])
    assert _world_size % TP_SIZE == 0, f"World size {_world_size} needs to be divisible by TP size {TP_SIZE}"
    dp_size = _world_size // TP_SIZE
    device_mesh = init_device_mesh("cpu", (dp_size, TP_SIZE), mesh_dim_names=("dp", "tp"))
    rank_log(_rank, logger, f"Device Mesh created: {device_mesh=}")
    tp_mesh = device_mesh["tp"]
    dp_mesh = device_mesh["dp"]
    dp_rank = dp_mesh.get_local_rank()

    sharded_model = parallelize(build_model(), tp_mesh, dp_mesh)
    rank_log(_rank, logger, f"Model after parallelization {sharded_model=}\n")
    optimizer = torch.optim.AdamW(sharded_model.parameters(), lr=LR, foreach=True)

    losses = []
    for i in range(NUM_ITERATIONS):
        inp, labels = get_batch(i, dp_rank)
        loss = loss_fn(sharded_model(inp), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        rank_log(_rank, logger, f"2D iter {i} complete")

    row = {"rank": _rank, "dp_rank": dp_rank, "tp_rank": tp_mesh.get_local_rank(), "losses": losses}
    print("RESULT " + json.dumps(row), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
