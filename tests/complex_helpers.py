"""Rank functions for test_dtensor_complex.py: complex DTensors, math bits and rotary embeddings against one process."""

from __future__ import annotations

from typing import Any

import torch

import spmd
from spmd import Replicate, Shard
from spmd.testing import opdb


def _rotary(xq: torch.Tensor, xk: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama's apply_rotary_emb: pairs of features as complex numbers, turned by the position's angle."""
    q = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    k = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    f = freqs.view(1, q.shape[1], 1, q.shape[-1])
    return torch.view_as_real(q * f).flatten(3), torch.view_as_real(k * f).flatten(3)


def _attention(xq: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    q, k = _rotary(xq, xk, freqs)
    q, k, v = (t.transpose(1, 2) for t in (q, k, xv))  # (batch, heads, seq, head_dim)
    scores = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
    return (scores.softmax(-1) @ v).transpose(1, 2)


def rotary_attention_heads_sharded() -> dict[str, Any]:
    """Rotary attention with heads split over the mesh: output and gradients against one process, and the
    complex products that used to lose the conjugate bit."""
    torch.manual_seed(0)
    batch, seq, heads, head_dim = 2, 6, 4, 8
    xq, xk, xv = (torch.randn(batch, seq, heads, head_dim, requires_grad=True) for _ in range(3))
    angles = torch.outer(torch.arange(seq).float(), 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.polar(torch.ones_like(angles), angles)
    weight = torch.randn(batch, seq, heads, head_dim)
    expected = _attention(xq, xk, xv, freqs)
    (expected * weight).sum().backward()

    mesh = spmd.init_device_mesh("cpu", (spmd.get_world_size(),))
    dq, dk, dv = (spmd.distribute_tensor(t.detach(), mesh, [Shard(2)]).requires_grad_() for t in (xq, xk, xv))
    dfreqs = spmd.distribute_tensor(freqs, mesh, [Replicate()])
    got = _attention(dq, dk, dv, dfreqs)
    (got * spmd.distribute_tensor(weight, mesh, [Shard(2)])).sum().backward()

    def gap(a: torch.Tensor, b: Any) -> float:
        return float((a.detach() - b.full_tensor().detach()).abs().max())

    z = spmd.distribute_tensor(torch.randn(4, 3, dtype=torch.complex64), mesh, [Replicate()])
    zs = spmd.distribute_tensor(z.full_tensor(), mesh, [Shard(0)])
    plain = z.full_tensor()
    return {
        "out": gap(expected, got),
        "grads": [gap(t.grad, d.grad) for t, d in ((xq, dq), (xk, dk), (xv, dv))],
        "placements": str(got.placements),
        "abs2": float((z * torch.conj(z)).full_tensor().sub(plain * plain.conj()).abs().max()),
        "abs2_sharded": float((zs * torch.conj(zs)).full_tensor().sub(plain * plain.conj()).abs().max()),
        "bits": (torch.conj(z).is_conj(), torch.conj(zs).is_conj(), torch.conj(z).imag.is_neg()),
        "conj_sharded": bool(torch.equal(torch.conj(zs).full_tensor(), plain.conj())),
        "real_of_conj": bool(torch.equal(torch.view_as_real(torch.conj(zs).resolve_conj()).full_tensor(),
                                         torch.view_as_real(plain.conj().resolve_conj()))),
    }


def sweep_counts(names: list[str] | None, with_torch: bool, max_samples: int | None = None) -> dict[str, Any]:
    """The op_db sweep on spmd's DTensor and, ``with_torch``, on torch's (over spmd's ProcessGroup), same samples."""
    from spmd.tensor.dispatch import dispatcher

    torch.set_num_threads(1)
    ops = opdb.op_infos(names)
    world = spmd.get_world_size()
    warned = set(dispatcher.warned)  # the fallback warns once per process: leave later tests in this world theirs
    try:
        ours = opdb.sweep(opdb.spmd_impl(), ops, world, max_samples=max_samples)
        theirs = opdb.sweep(opdb.torch_impl(), ops, world, max_samples=max_samples) if with_torch else None
    finally:
        dispatcher.warned.clear()
        dispatcher.warned.update(warned)
    return {
        "spmd": ours.summary(),
        "torch": theirs.summary() if theirs is not None else None,
        "mismatches": [f"{c.op} {c.dtype} {c.layout} sample {c.sample}: {c.detail}" for c in ours.mismatches()],
    }
