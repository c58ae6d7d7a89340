"""Train a character-level transformer language model with spmd DDP.

    spmd run --nproc-per-node 2 examples/train.py
    spmd run --nproc-per-node 2 examples/train.py --steps 400 --batch-size 32 --out checkpoints/lm.pt
    spmd run --nproc-per-node 2 examples/train.py --save-every 50 --checkpoint-dir ckpt --resume   # continues from ckpt
    python examples/train.py                          # a world of one
    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc-per-node 2 examples/train.py   # torchrun works too

The corpus is generated deterministically (English-like sentences from a small
grammar; ``--data FILE`` trains on a text file instead). Each rank trains on
its own contiguous shard of the training text; DDP averages the gradients, so
the ranks keep one model. Rank 0 shows a progress bar with the per-step loss
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
from pathlib import Path

import checkpointing
import torch
from model import CharGPT, CharTokenizer, GPTConfig, make_corpus, random_windows
from torch.nn import functional as F
from tqdm import tqdm

import spmd
from spmd.parallel import DistributedDataParallel


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps")
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
    return parser.parse_args()


def learning_rate(step: int, args: argparse.Namespace) -> float:
    warmup = max(1, args.steps // 20)
    if step < warmup:
        return args.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, args.steps - warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: torch.Tensor, args: argparse.Namespace, batches: int = 8) -> float:
    """Mean validation loss on this rank's fixed windows, averaged over the ranks."""
    model.eval()
    generator = torch.Generator().manual_seed(args.seed + 1)
    total = torch.zeros(1)
    for _ in range(batches):
        x, y = random_windows(data, args.batch_size, args.context, generator)
        total += F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    model.train()
    spmd.all_reduce(total, op=spmd.ReduceOp.AVG)
    return total.item() / batches


def main() -> None:
    args = parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    spmd.init()  # rank and world size from the launcher's environment (a world of one without it)
    rank, world = spmd.get_rank(), spmd.get_world_size()
    leader = rank == 0

    # -- data: one tokenizer for all, a contiguous shard of the training text per rank --
    text = args.data.read_text() if args.data else make_corpus(args.corpus_chars, seed=args.seed)
    tokenizer = CharTokenizer(text)
    ids = tokenizer.encode(text)
    split = int(0.9 * ids.numel())
    train, val = ids[:split], ids[split:]
    shard = train.chunk(world)[rank]
    generator = torch.Generator().manual_seed(args.seed + 1000 * (rank + 1))

    # -- model: built the same way everywhere; DDP broadcasts rank 0's weights --
    torch.manual_seed(args.seed)
    cfg = GPTConfig(vocab_size=tokenizer.vocab_size, context=args.context, d_model=args.d_model,
                    n_layers=args.layers, n_heads=args.heads)
    model = DistributedDataParallel(CharGPT(cfg))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    n_params = sum(p.numel() for p in model.parameters())
    if leader:
        print(f"world {world} ({spmd.get_backend()}), {n_params / 1e6:.2f} M parameters, vocab {tokenizer.vocab_size}, "
              f"{shard.numel()} training characters per rank, {args.batch_size}x{args.context} tokens per rank per step",
              flush=True)

    tokens_per_step = world * args.batch_size * args.context
    bar = tqdm(total=args.steps, disable=not leader, unit="step", dynamic_ncols=True)
    first_loss = last_loss = float("nan")
    start = time.perf_counter()
    first_step = checkpointing.resume(args, model, optimizer, generator)
    bar.update(first_step)
    for step in range(first_step, args.steps):
        step_start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args)
        x, y = random_windows(shard, args.batch_size, args.context, generator)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # returns with gradients averaged over the ranks
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        checkpointing.maybe_save(args, step, model, optimizer, generator)
        last_loss = loss.item()  # this rank's loss on its own batch
        if step == 0:
            first_loss = last_loss
        tokens_per_s = tokens_per_step / (time.perf_counter() - step_start)
        bar.set_postfix(loss=f"{last_loss:.3f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
        bar.update()
        if leader and (step % args.log_every == 0 or step == args.steps - 1):
            bar.write(f"step {step:5d}  loss {last_loss:.4f}  lr {learning_rate(step, args):.2e}  {tokens_per_s:,.0f} tok/s")
    bar.close()
    checkpointing.finish()
    elapsed = time.perf_counter() - start

    val_loss = evaluate(model, val, args)
    if leader:
        print(f"done: {args.steps} steps in {elapsed:.1f} s, {tokens_per_step * args.steps / elapsed:,.0f} tok/s; "
              f"loss {first_loss:.3f} -> {last_loss:.3f} (uniform guess: {math.log(tokenizer.vocab_size):.3f}), "
              f"validation loss {val_loss:.3f}")
        prompt = tokenizer.encode("The ")
        sample = model.module.generate(prompt, 120, generator=torch.Generator().manual_seed(args.seed))
        print("sample:", tokenizer.decode(sample).replace("\n", " / "))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), args.out)  # plain keys: CharGPT(cfg).load_state_dict(...) reads it
        print(f"saved {args.out}")
    spmd.destroy_process_group()


if __name__ == "__main__":
    main()
