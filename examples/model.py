"""The model and data of examples/train.py: a character-level transformer language model.

Nothing here knows about distribution; train.py wraps the model in DDP and
shards the data.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

# -- corpus ----------------------------------------------------------------------------
_SUBJECTS = ["the cat", "a dog", "my friend", "the old man", "a small bird", "the teacher",
             "our neighbour", "the sailor", "a child", "the baker"]
_VERBS = ["sees", "follows", "likes", "finds", "remembers", "carries", "watches", "paints", "forgets", "sells"]
_OBJECTS = ["the moon", "a red ball", "the garden", "an apple", "the quiet town", "a long letter",
            "the sea", "a warm loaf", "the blue door", "an old map"]
_ADVERBS = ["slowly", "today", "again", "at night", "with care", "in the rain", "every morning", "once more"]


def _clause(rng: random.Random) -> str:
    text = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
    return text + f" {rng.choice(_ADVERBS)}" if rng.random() < 0.5 else text


def make_corpus(n_chars: int, seed: int = 0) -> str:
    """Deterministic English-like text from a small grammar: learnable structure, no download."""
    rng = random.Random(seed)
    out: list[str] = []
    size = 0
    while size < n_chars:
        kind = rng.random()
        if kind < 0.6:
            sentence = _clause(rng)
        elif kind < 0.85:
            sentence = f"when {_clause(rng)}, {_clause(rng)}"
        else:
            sentence = f"{_clause(rng)} and {_clause(rng)}"
        sentence = sentence[0].upper() + sentence[1:] + "."
        sentence += "\n" if rng.random() < 0.2 else " "
        out.append(sentence)
        size += len(sentence)
    return "".join(out)[:n_chars]


class CharTokenizer:
    """Characters to ids and back, over the characters of a corpus."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.index[c] for c in text], dtype=torch.long)

    def decode(self, ids: torch.Tensor) -> str:
        return "".join(self.chars[i] for i in ids.tolist())


# -- model -----------------------------------------------------------------------------
@dataclass
class GPTConfig:
    vocab_size: int
    context: int = 64
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    dropout: float = 0.0


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.q = nn.Linear(cfg.d_model, cfg.d_model)  # three projections, not one fused: tensor parallel
        self.k = nn.Linear(cfg.d_model, cfg.d_model)  # then splits the heads across ranks (see train.py --tp)
        self.v = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(), nn.Linear(4 * cfg.d_model, cfg.d_model))
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = (proj(h).view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for proj in (self.q, self.k, self.v))
        attn = F.scaled_dot_product_attention(
            q, k, v, is_causal=True,
            dropout_p=self.dropout if self.training else 0.0,
        )
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    """A small GPT over characters: token and position embeddings, blocks, a linear head."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.Sequential(*[Block(cfg) for _ in range(cfg.n_layers)])
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits of the next character at every position of ``ids`` (batch, time)."""
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.head(self.ln(self.blocks(self.tok(ids) + self.pos(positions))))

    @torch.no_grad()
    def generate(self, ids: torch.Tensor, n: int, temperature: float = 0.8, generator: torch.Generator | None = None) -> torch.Tensor:
        """Extend ``ids`` (1-d) by ``n`` sampled characters."""
        out = ids.clone()
        for _ in range(n):
            logits = self(out[-self.cfg.context :].unsqueeze(0))[0, -1] / temperature
            out = torch.cat([out, torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)])
        return out


class Embed(nn.Module):
    """CharGPT's input end as one layer (token and position embeddings), for pipeline stages."""

    def __init__(self, model: CharGPT) -> None:
        super().__init__()
        self.tok, self.pos = model.tok, model.pos

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))


class Head(nn.Module):
    """CharGPT's output end as one layer (final norm and linear head), for pipeline stages."""

    def __init__(self, model: CharGPT) -> None:
        super().__init__()
        self.ln, self.head = model.ln, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(x))


def as_layers(model: CharGPT) -> nn.Sequential:
    """The model as a flat sequence of layers sharing its parameters: embeddings, blocks, head."""
    return nn.Sequential(Embed(model), *model.blocks, Head(model))


def random_windows(data: torch.Tensor, batch: int, context: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` random (input, next-character target) windows of length ``context`` from ``data``."""
    starts = torch.randint(0, data.numel() - context - 1, (batch,), generator=generator)
    offsets = torch.arange(context)
    x = data[starts[:, None] + offsets]
    return x, data[starts[:, None] + offsets + 1]
