"""Train a character-level transformer language model with spmd DDP, FSDP or tensor parallelism.

    spmd run --nproc-per-node 2 examples/train.py
    spmd run --nproc-per-node 2 examples/train.py --strategy fsdp   # sharded: fully_shard per block, then the model
    spmd run --nproc-per-node 2 examples/train.py --tp 2          # tensor parallel: heads and MLP split over 2 ranks
    spmd run --nproc-per-node 4 examples/train.py --tp 2          # 2-D: tensor parallel 2 x data parallel 2
    spmd run --nproc-per-node 4 examples/train.py --strategy fsdp --dp 2 --tp 2   # 2-D: tensor parallel inside FSDP
    spmd run --nproc-per-node 2 examples/train.py --pp 2          # pipeline: 2 stages, 1F1B, 4 microbatches
    spmd run --nproc-per-node 4 examples/train.py --pp 2 --strategy fsdp   # 2-D: 2 stages, each sharded over 2 ranks
    spmd run --nproc-per-node 2 examples/train.py --steps 400 --batch-size 32 --out checkpoints/lm.pt
    spmd run --nproc-per-node 2 examples/train.py --save-every 50 --checkpoint-dir ckpt --resume   # continues from ckpt
    python examples/train.py                          # a world of one
    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc-per-node 2 examples/train.py   # torchrun works too

The corpus is generated deterministically (English-like sentences from a small
grammar; ``--data FILE`` trains on a text file instead). Each rank trains on
its own contiguous shard of the training text; DDP averages the gradients, so
the ranks keep one model. ``--strategy fsdp`` shards each block and the rest
of the model over the ranks instead (``spmd.parallel.fully_shard``): the same
loss curve as DDP up to float rounding, with a fraction of the parameter and
optimizer memory per rank. ``--tp N`` splits attention heads, MLPs and the
vocabulary of the output layer over N ranks (``parallelize_module``; the
cross-entropy runs on vocabulary-sharded logits under ``loss_parallel``) and
keeps world/N data-parallel replicas of that (``--dp``), whose gradients are
averaged, or, with ``--strategy fsdp``, sharded over them (TP inside FSDP on
one (dp, tp) mesh). ``--pp N`` cuts embeddings,
blocks and head into N pipeline stages run by ``--schedule`` (spmd.pipeline);
the other ranks are data-parallel replicas of each stage (averaged, or sharded
with ``--strategy fsdp``).
Rank 0 shows a progress bar with the per-step loss
and the global throughput (tokens/s), prints the loss every ``--log-every``
steps and the validation loss at the end, samples some text, and saves the
final state dict (plain keys, loadable into ``CharGPT``) to ``--out``.
With the defaults it runs in about a minute on two CPU cores.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from contextlib import nullcontext
from pathlib import Path

import checkpointing
import torch
from model import CharGPT, CharTokenizer, GPTConfig, as_layers, make_corpus, random_windows
from torch.nn import functional as F
from tqdm import tqdm

import spmd
from spmd import Replicate
from spmd.launch.console import console_is_terminal
from spmd.parallel import (
    ColwiseParallel,
    DistributedDataParallel,
    RowwiseParallel,
    clip_grad_norm_,
    fully_shard,
    get_full_state_dict,
    loss_parallel,
    parallelize_module,
)
from spmd.pipeline import PipelineStage, get_schedule, split_module
from spmd.tensor import DTensor


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps")
    parser.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp", help="data parallel or fully sharded")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel degree: heads and MLP split over this many ranks (a divisor of the world "
                             "and of --heads); the other ranks hold data-parallel replicas")
    parser.add_argument("--dp", type=int, default=0,
                        help="data-parallel degree (default: the world divided by --tp and --pp; if given it must be that)")
    parser.add_argument("--pp", type=int, default=1,
                        help="pipeline stages: embeddings, blocks and head cut into this many stages, one per rank "
                             "(a divisor of the world); the other ranks hold data-parallel replicas")
    parser.add_argument("--schedule", default="1f1b", help="pipeline schedule (see `spmd pipeline show NAME`): "
                        "gpipe, 1f1b, zb_h1, or one a plugin provides")
    parser.add_argument("--microbatches", type=int, default=4, help="pipeline microbatches per step")
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per rank per step")
    parser.add_argument("--context", type=int, default=64, help="characters per sequence")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW, warmup then cosine)")
    parser.add_argument("--corpus-chars", type=int, default=300_000, help="size of the generated corpus")
    parser.add_argument("--data", type=Path, default=None, help="train on this text file instead")
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("checkpoints/train_final.pt"))
    checkpointing.add_arguments(parser)  # --save-every K --checkpoint-dir DIR --resume
    return parser.parse_args(argv)


def learning_rate(step: int, args: argparse.Namespace) -> float:
    warmup = max(1, args.steps // 20)
    if step < warmup:
        return args.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, args.steps - warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


TP_PLAN = {
    # heads split across the tensor-parallel ranks: q/k/v keep DTensor outputs, so Block.forward's
    # view(b, t, n_heads, head_dim) runs unchanged with the global head count
    "blocks.*.q": ColwiseParallel(use_local_output=False),
    "blocks.*.k": ColwiseParallel(use_local_output=False),
    "blocks.*.v": ColwiseParallel(use_local_output=False),
    "blocks.*.proj": RowwiseParallel(),
    "blocks.*.mlp.0": ColwiseParallel(),
    "blocks.*.mlp.2": RowwiseParallel(),
    "head": ColwiseParallel(use_local_output=False),  # logits stay sharded over the vocabulary: loss_parallel
}


def compute_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, tp_mesh: spmd.DeviceMesh | None) -> torch.Tensor:
    """Next-character cross-entropy; with tensor parallelism call it inside ``loss_parallel()``."""
    logits = model(x).flatten(0, 1)
    if tp_mesh is None:
        return F.cross_entropy(logits, y.flatten())
    return F.cross_entropy(logits, DTensor.from_local(y.flatten(), tp_mesh, [Replicate()]))


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


@torch.no_grad()
def clip_across(parameters: list[torch.nn.Parameter], max_norm: float, group: spmd.ProcessGroup | None) -> None:
    """clip_grad_norm_ over a model whose gradients are spread over ``group`` (pipeline stages, FSDP shards)."""
    grads = [as_local(p.grad) for p in parameters if p.grad is not None]
    total = torch.stack([g.pow(2).sum() for g in grads]).sum() if grads else torch.zeros(())
    spmd.all_reduce(total, group=group)
    scale = torch.clamp(max_norm / (total.sqrt() + 1e-6), max=1.0)
    for g in grads:
        g.mul_(scale)


def gather_stages(full: torch.nn.Module, piece: torch.nn.Module, group: spmd.ProcessGroup) -> dict[str, torch.Tensor]:
    """The whole model's state dict on the first rank of ``group``, from each stage's parameters."""
    mine = {id(p) for p in piece.parameters()}
    # FSDP stages: full_tensor gathers each shard over dp (every rank of the stage calls it in one order)
    owned = {k: as_full(v.detach()).clone() for k, v in full.named_parameters() if id(v) in mine}
    pieces: list = [None] * group.size if group.rank == 0 else []
    spmd.gather_object(owned, pieces if group.rank == 0 else None, group_dst=0, group=group)
    state = dict(full.state_dict())
    for part in pieces:
        state.update(part or {})
    return state


def as_local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (anything else unchanged)."""
    return t._local_tensor if isinstance(t, DTensor) else t


def as_full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered in full (a collective over its mesh; anything else unchanged)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def as_plain(t: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor's value as a plain tensor (anything else unchanged)."""
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def average_gradients(model: torch.nn.Module, group: spmd.ProcessGroup) -> None:
    """Average every gradient's local part over ``group`` (data parallel beside tensor parallel), in one all-reduce."""
    grads = [as_plain(p.grad) for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    spmd.all_reduce(flat, op=spmd.ReduceOp.AVG, group=group)
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


def pipeline_step(schedule: object, x: torch.Tensor, y: torch.Tensor, stage_index: int, stages: int,
                  group: spmd.ProcessGroup) -> torch.Tensor:
    """One pipeline step (forward and backward of every microbatch); the batch loss on every stage."""
    losses: list[torch.Tensor] = []
    if stage_index == 0:
        schedule.step(x)  # type: ignore[attr-defined]
    elif stage_index == stages - 1:
        schedule.step(target=y, losses=losses)  # type: ignore[attr-defined]
    else:
        schedule.step()  # type: ignore[attr-defined]
    loss = torch.stack([part.detach() for part in losses]).mean() if losses else torch.zeros(())
    spmd.broadcast(loss, group_src=stages - 1, group=group)  # the last stage knows it; rank 0 prints it
    return loss


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: torch.Tensor, args: argparse.Namespace, batches: int = 8,
             tp_mesh: spmd.DeviceMesh | None = None, average: bool = True) -> float:
    """Mean validation loss on this rank's fixed windows, averaged over the ranks (unless not ``average``)."""
    model.eval()
    generator = torch.Generator().manual_seed(args.seed + 1)
    total = torch.zeros(1)
    for _ in range(batches):
        x, y = random_windows(data, args.batch_size, args.context, generator)
        with loss_parallel() if tp_mesh is not None else nullcontext():
            total += as_plain(compute_loss(model, x, y, tp_mesh))
    model.train()
    if average:
        spmd.all_reduce(total, op=spmd.ReduceOp.AVG)
    return total.item() / batches


def main(argv: list[str] | None = None) -> dict[str, object]:
    """Train as this command line (``argv``, default sys.argv) says; this rank's losses, by step, and validation loss.

    A callable, so that other launchers run it too (examples/train_ray.py: Ray workers).
    """
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if not spmd.is_initialized():  # a launcher may have joined already (spmd.integrations.ray with backend=)
        spmd.init()  # rank and world size from the launcher's environment (a world of one without it)
    rank, world = spmd.get_rank(), spmd.get_world_size()
    leader = rank == 0

    # -- data: one tokenizer for all, a contiguous shard of the training text per rank --
    text = args.data.read_text() if args.data else make_corpus(args.corpus_chars, seed=args.seed)
    tokenizer = CharTokenizer(text)
    ids = tokenizer.encode(text)
    split = int(0.9 * ids.numel())
    train, val = ids[:split], ids[split:]
    if world % args.tp or args.heads % args.tp:
        raise SystemExit(f"--tp {args.tp} must divide the world size {world} and --heads {args.heads}")
    if world % args.pp or (args.pp > 1 and args.tp > 1):
        raise SystemExit(f"--pp {args.pp} must divide the world size {world}, without --tp")
    if args.dp and args.dp * args.tp * args.pp != world:
        raise SystemExit(f"--dp {args.dp} x --tp {args.tp} x --pp {args.pp} must equal the world size {world}")
    mesh = spmd.init_device_mesh("cpu", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp")) if args.tp > 1 else None
    if args.pp > 1:
        mesh = spmd.init_device_mesh("cpu", (world // args.pp, args.pp), mesh_dim_names=("dp", "pp"))
    tp_mesh = mesh["tp"] if args.tp > 1 and mesh is not None else None
    replica, replicas = (mesh.get_local_rank("dp"), mesh.size("dp")) if mesh is not None else (rank, world)
    shard = train.chunk(replicas)[replica]  # the ranks of one tensor-parallel group see the same batch
    generator = torch.Generator().manual_seed(args.seed + 1000 * (replica + 1))

    # -- model: built the same way everywhere; DDP broadcasts rank 0's weights, FSDP keeps each rank's rows --
    torch.manual_seed(args.seed)
    cfg = GPTConfig(vocab_size=tokenizer.vocab_size, context=args.context, d_model=args.d_model,
                    n_layers=args.layers, n_heads=args.heads)
    model: torch.nn.Module
    full: CharGPT | None = None
    if args.pp > 1:
        assert mesh is not None
        full = CharGPT(cfg)  # every rank builds it alike and keeps its stage's layers
        stage_index, pp_group = mesh.get_local_rank("pp"), mesh.get_group("pp")
        model = split_module(as_layers(full), num_stages=args.pp)[stage_index]
        if args.strategy == "fsdp":  # each layer of the stage sharded over the data-parallel replicas
            for layer in model:
                if any(True for _ in layer.parameters()):
                    fully_shard(layer, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
        stage = PipelineStage(model, stage_index, args.pp, "cpu", group=pp_group)
        schedule = get_schedule(args.schedule)(stage, args.microbatches, loss_fn=lm_loss)
        # FSDP: the stages' gradients are also sharded over dp, so the norm sums over every rank (the world)
        norm_group = None if args.strategy == "fsdp" else pp_group
        clip = lambda params, max_norm: clip_across(list(params), max_norm, norm_group)  # noqa: E731
    elif mesh is not None:
        model = parallelize_module(CharGPT(cfg), mesh["tp"], TP_PLAN)
        if args.strategy == "fsdp":  # 2-D: each tensor-parallel piece sharded again over the replicas
            for block in model.blocks:
                fully_shard(block, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
        clip = clip_grad_norm_  # one scalar all-reduce per sharding group
    elif args.strategy == "fsdp":
        model = CharGPT(cfg)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        clip = clip_grad_norm_  # one scalar all-reduce; torch's clip_grad_norm_ would gather every gradient
    else:
        model = DistributedDataParallel(CharGPT(cfg))
        clip = torch.nn.utils.clip_grad_norm_
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    n_params = sum(p.numel() for p in model.parameters())
    if leader:
        layout = args.strategy
        if mesh is not None:
            kind = f"tensor parallel {args.tp}" if args.tp > 1 else f"pipeline {args.pp} stages ({args.schedule})"
            layout = f"{kind} x {'fully sharded' if args.strategy == 'fsdp' else 'data parallel'} {replicas}"
        if full is not None:
            n_params = sum(p.numel() for p in full.parameters())
        print(f"world {world} ({spmd.get_backend()}, {layout}), {n_params / 1e6:.2f} M parameters, "
              f"vocab {tokenizer.vocab_size}, "
              f"{shard.numel()} training characters per rank, {args.batch_size}x{args.context} tokens per rank per step",
              flush=True)

    tokens_per_step = replicas * args.batch_size * args.context
    # the bar only on a terminal (spmd run's too, which pipes our output to it): in a log file its redraws are
    # noise; the --log-every lines print either way
    bar = tqdm(total=args.steps, disable=not (leader and console_is_terminal()), unit="step", dynamic_ncols=True)
    first_loss = last_loss = float("nan")
    losses: dict[int, float] = {}
    first_step = checkpointing.resume(args, model, optimizer, generator)
    bar.update(first_step)
    start = time.perf_counter()  # after the resume: the rate is over the steps this run trains
    for step in range(first_step, args.steps):
        step_start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args)
        x, y = random_windows(shard, args.batch_size, args.context, generator)
        optimizer.zero_grad(set_to_none=True)
        if args.pp > 1:
            loss = pipeline_step(schedule, x, y, stage_index, args.pp, pp_group)
        else:
            with loss_parallel() if tp_mesh is not None else nullcontext():
                loss = compute_loss(model, x, y, tp_mesh)
                loss.backward()  # returns with gradients averaged over the ranks (FSDP: each rank's rows of them)
        if mesh is not None and replicas > 1 and args.strategy != "fsdp":
            average_gradients(model, mesh.get_group("dp"))
        clip(model.parameters(), 1.0)
        optimizer.step()
        checkpointing.maybe_save(args, step, model, optimizer, generator)
        last_loss = losses[step] = as_plain(loss).item()  # this rank's loss on its own batch
        if step == first_step:
            first_loss = last_loss
        tokens_per_s = tokens_per_step / (time.perf_counter() - step_start)
        bar.set_postfix(loss=f"{last_loss:.3f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
        bar.update()
        if leader and (step % args.log_every == 0 or step == args.steps - 1):
            bar.write(f"step {step:5d}  loss {last_loss:.4f}  lr {learning_rate(step, args):.2e}  {tokens_per_s:,.0f} tok/s")
    bar.close()
    checkpointing.finish()
    elapsed = time.perf_counter() - start

    if full is not None:  # pipeline: the first rank of each stage group holds the whole model afterwards
        state = gather_stages(full, model, pp_group)
        val_loss = float("nan")
        if leader:  # on a plain model: the stages' modules may be sharded over the other ranks
            whole = CharGPT(cfg)
            whole.load_state_dict(state)
            val_loss = evaluate(whole, val, args, average=False)
    else:
        val_loss = evaluate(model, val, args, tp_mesh=tp_mesh)
    # Plain keys, loadable into CharGPT; with FSDP every rank takes part in gathering, rank 0 keeps the result.
    if full is not None:
        pass  # gathered above
    elif args.strategy == "fsdp":
        state = get_full_state_dict(model)
    elif mesh is not None:
        state = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    else:
        state = model.state_dict()
    if leader:
        ran = args.steps - first_step
        if ran <= 0:
            print(f"done: the run was already complete ({args.steps} steps, resumed at step {first_step}); nothing "
                  f"to train; validation loss {val_loss:.3f}")
        else:
            span = f"steps {first_step}-{args.steps - 1} (resumed)" if first_step else f"{ran} steps"
            print(f"done: {span} in {elapsed:.1f} s, {tokens_per_step * ran / elapsed:,.0f} tok/s; "
                  f"loss {first_loss:.3f} -> {last_loss:.3f} (uniform guess: {math.log(tokenizer.vocab_size):.3f}), "
                  f"validation loss {val_loss:.3f}")
        prompt = tokenizer.encode("The ")
        plain = CharGPT(cfg)
        plain.load_state_dict(state)  # generate on rank 0 alone: a sharded model would need every rank
        sample = plain.generate(prompt, 120, generator=torch.Generator().manual_seed(args.seed))
        print("sample:", tokenizer.decode(sample).replace("\n", " / "))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, args.out)  # plain keys: CharGPT(cfg).load_state_dict(...) reads it
        print(f"saved {args.out}")
    spmd.destroy_process_group()
    return {"rank": rank, "losses": losses, "validation_loss": val_loss}


if __name__ == "__main__":
    main()
