"""torch's operator database as a DTensor test suite: every OpInfo's samples through DTensor, against plain torch.

``sweep`` runs each op's sample inputs (from
``torch.testing._internal.common_methods_invocations.op_db``; it needs the
``expecttest`` package) with every tensor ``Replicate``, and again with the
first one ``Shard(0)`` where the mesh divides its first dimension, and
compares the whole result (values, shape, dtype, conjugate and negative bits)
and, for ops with autograd, the gradient with the same call on plain tensors.
Each case ends as ``match``, ``error`` (the op raised: a refusal, never a
wrong answer) or ``mismatch`` (a wrong result without an error: a bug).

The sweep runs the same way on any DTensor implementation through an
``Impl`` (``spmd_impl()`` or ``torch_impl()``), so a rule plugin can run it
against its own rules and a report can put spmd beside torch's DTensor.
Every rank must call it with the same arguments; it uses only the mesh's
collectives, and rebuilds the mesh when an error left a group unusable.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

#: Ops whose result is random or uninitialised memory: no two runs agree, so they cannot be compared.
NONDETERMINISTIC = frozenset(
    {
        "bernoulli", "cauchy", "empty", "empty_like", "empty_permuted", "empty_strided", "exponential",
        "geometric", "log_normal", "multinomial", "new_empty", "new_empty_strided", "normal", "rand_like",
        "randint", "randint_like", "randn", "randn_like", "uniform", "nn.functional.alpha_dropout",
        "nn.functional.dropout", "nn.functional.dropout1d", "nn.functional.dropout2d", "nn.functional.dropout3d",
        "nn.functional.feature_alpha_dropout", "nn.functional.rrelu", "torch._C._nn.rrelu",
        "nn.functional.fractional_max_pool2d", "nn.functional.fractional_max_pool3d", "bfloat16", "nonzero_static",
        "cuda.FloatTensor", "svd_lowrank", "pca_lowrank", "linalg.lstsq",
    }
)

#: The fast subset that the default test run sweeps: complex and view ops, the ops a transformer's step makes.
FAST_OPS = (
    "add", "mul", "div", "sub", "neg", "conj", "conj_physical", "resolve_conj", "resolve_neg", "view_as_real",
    "view_as_complex", "real", "imag", "abs", "angle", "polar", "complex", "exp", "sin", "rsqrt", "sigmoid",
    "view", "reshape", "transpose", "permute", "flatten", "unflatten", "expand", "cat", "stack", "split",
    "chunk", "narrow", "select", "unsqueeze", "squeeze", "sum", "mean", "amax", "var", "norm", "matmul", "mm",
    "bmm", "addmm", "einsum", "softmax", "log_softmax", "nn.functional.linear", "nn.functional.layer_norm",
    "nn.functional.rms_norm", "nn.functional.gelu", "nn.functional.silu", "nn.functional.embedding",
    "nn.functional.cross_entropy", "nn.functional.scaled_dot_product_attention", "where", "masked_fill",
    "clone", "contiguous", "to", "type_as", "zeros_like", "ones_like", "full_like", "cumsum", "roll", "tril",
)


@dataclass(frozen=True)
class Impl:
    """One DTensor implementation, as the sweep uses it."""

    name: str
    dtensor_type: type
    distribute: Callable[[torch.Tensor, Any, list[Any]], Any]  # (tensor, mesh, placements) -> DTensor, no comm
    shard: Callable[[int], Any]
    replicate: Callable[[], Any]
    new_mesh: Callable[[int], Any]  # world size -> a fresh 1-D mesh with its own groups


@dataclass
class Case:
    """One sample of one op, in one dtype and layout, and how it ended."""

    op: str
    dtype: str
    layout: str  # "replicate" or "shard0"
    sample: int
    outcome: str  # "match", "error" or "mismatch"
    detail: str = ""


@dataclass
class Report:
    """The cases of one sweep on one rank, with counts by outcome."""

    impl: str
    cases: list[Case] = field(default_factory=list)

    def count(self, outcome: str) -> int:
        return sum(1 for c in self.cases if c.outcome == outcome)

    def mismatches(self) -> list[Case]:
        return [c for c in self.cases if c.outcome == "mismatch"]

    def summary(self) -> dict[str, int]:
        return {o: self.count(o) for o in ("match", "error", "mismatch")}


def spmd_impl() -> Impl:
    """spmd's DTensor."""
    import spmd
    from spmd.tensor import DTensor

    return Impl(
        "spmd",
        DTensor,
        lambda t, mesh, placements: spmd.distribute_tensor(t, mesh, placements, src_data_rank=None),
        spmd.Shard,
        spmd.Replicate,
        lambda n: spmd.init_device_mesh("cpu", (n,)),
    )


def torch_impl() -> Impl:
    """torch's own DTensor (``torch.distributed.tensor``), for the side-by-side counts."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    return Impl(
        "torch",
        DTensor,
        lambda t, mesh, placements: distribute_tensor(t, mesh, placements, src_data_rank=None),
        Shard,
        Replicate,
        lambda n: init_device_mesh("cpu", (n,)),
    )


def op_infos(names: Iterable[str] | None = None) -> list[Any]:
    """The OpInfos of torch's database (all of them, or those ``names`` names), minus the random ones."""
    from torch.testing._internal.common_methods_invocations import op_db

    wanted = set(names) if names is not None else None
    return [
        op for op in op_db
        if op.name not in NONDETERMINISTIC and (wanted is None or op.name in wanted)
    ]


def sweep(
    impl: Impl,
    ops: Sequence[Any],
    world_size: int,
    *,
    dtypes: Sequence[torch.dtype] = (torch.float32, torch.complex64),
    max_samples: int | None = None,
    case_seconds: float | None = None,
) -> Report:
    """Every sample of ``ops`` through ``impl``'s DTensor on a 1-D mesh of ``world_size`` ranks, against torch.

    ``case_seconds`` bounds one case (main thread only): a DTensor that computes longer (torch's loops forever
    planning ``unflatten`` into a zero-sized dimension) ends the case as an error naming the limit.
    """
    report = Report(impl.name)
    mesh = impl.new_mesh(world_size)
    for op in ops:
        for dtype in dtypes:
            if dtype not in op.supported_dtypes("cpu"):
                continue
            for index, sample in enumerate(_samples(op, dtype, max_samples)):
                for layout in ("replicate", "shard0"):
                    try:
                        with _time_limit(case_seconds):
                            case = _run_case(impl, mesh, op, sample, layout, world_size)
                    except CaseTimeLimit as error:  # (outside the case's own error handling: still its outcome)
                        case = Case(op.name, "", layout, 0, "error", f"CaseTimeLimit: {error}")
                    if case is None:
                        continue
                    case.dtype, case.sample = str(dtype).removeprefix("torch."), index
                    report.cases.append(case)
                    if case.outcome == "error":
                        mesh = impl.new_mesh(world_size)  # an error mid-collective may have broken its groups
    return report


class CaseTimeLimit(Exception):
    """A case ran past the sweep's ``case_seconds``."""


@contextlib.contextmanager
def _time_limit(seconds: float | None) -> Iterator[None]:
    """Raise CaseTimeLimit in the main thread after ``seconds`` (a Python-level loop is interrupted; a C call
    returns first). Nothing when ``seconds`` is None or off the main thread."""
    if seconds is None or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise CaseTimeLimit(f"no result within {seconds:g} s (the sweep's per-case limit)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _samples(op: Any, dtype: torch.dtype, limit: int | None) -> list[Any]:
    torch.manual_seed(0)  # every rank draws the same samples
    grad = op.supports_autograd and (dtype.is_floating_point or dtype.is_complex)
    try:
        samples = list(op.sample_inputs("cpu", dtype, requires_grad=grad))
    except Exception:  # noqa: BLE001 - an OpInfo that cannot make samples on this build has nothing to sweep
        return []
    return samples[:limit] if limit is not None else samples


def _plain_leaves(sample: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten((sample.input, sample.args, sample.kwargs))
    return [x for x in leaves if isinstance(x, torch.Tensor)]


def _usable(t: torch.Tensor) -> bool:
    return t.layout == torch.strided and not (t.is_quantized or t.is_nested or t.is_conj() or t.is_neg())


def _run_case(impl: Impl, mesh: Any, op: Any, sample: Any, layout: str, world_size: int) -> Case | None:
    leaves = _plain_leaves(sample)
    if not leaves or not all(_usable(t) for t in leaves):
        return None
    first = leaves[0]
    if layout == "shard0" and (first.ndim == 0 or first.shape[0] == 0 or first.shape[0] % world_size):
        return None
    case = Case(op.name, "", layout, 0, "match")
    seen = {"first": True}

    def plain(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        return t.detach().clone().requires_grad_(t.requires_grad)

    def distributed(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        placement = impl.shard(0) if layout == "shard0" and seen["first"] else impl.replicate()
        seen["first"] = False
        return impl.distribute(t.detach().clone(), mesh, [placement]).requires_grad_(t.requires_grad)

    ref_args = tree_map(plain, (sample.input, sample.args, sample.kwargs))
    try:
        expected = op(ref_args[0], *ref_args[1], **ref_args[2])
    except Exception:  # noqa: BLE001 - torch itself refuses this sample: nothing to compare
        return None
    dt_args = tree_map(distributed, (sample.input, sample.args, sample.kwargs))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = op(dt_args[0], *dt_args[1], **dt_args[2])
            problem = _compare(impl, expected, got, "output")
            if problem is None and op.supports_autograd:
                problem = _compare_grads(impl, mesh, expected, got, ref_args, dt_args)
    except Exception as error:  # noqa: BLE001 - a refusal is an outcome, not a failure of the sweep
        case.outcome = "error"
        case.detail = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]
        return case
    if problem is not None:
        case.outcome, case.detail = "mismatch", problem
    return case


def _full(impl: Impl, x: Any) -> Any:
    return x.full_tensor() if isinstance(x, impl.dtensor_type) else x  # type: ignore[attr-defined]


def _compare(impl: Impl, expected: Any, got: Any, what: str) -> str | None:
    """None when ``got`` (DTensors gathered) equals ``expected`` in values, shape, dtype and math bits."""
    exp_leaves, exp_spec = tree_flatten(expected)
    got_leaves, got_spec = tree_flatten(got)
    if len(exp_leaves) != len(got_leaves):
        return f"{what}: {len(got_leaves)} results, torch gives {len(exp_leaves)}"
    for i, (e, g) in enumerate(zip(exp_leaves, got_leaves)):
        if isinstance(e, torch.Tensor):
            if not isinstance(g, torch.Tensor):
                return f"{what}[{i}]: a {type(g).__name__}, torch gives a tensor"
            if isinstance(g, impl.dtensor_type) and (g.is_conj() != e.is_conj() or g.is_neg() != e.is_neg()):
                return f"{what}[{i}]: conj/neg bits {(g.is_conj(), g.is_neg())}, torch gives {(e.is_conj(), e.is_neg())}"
            full = _full(impl, g)
            if full.shape != e.shape or full.dtype != e.dtype:
                return f"{what}[{i}]: {full.dtype}{list(full.shape)}, torch gives {e.dtype}{list(e.shape)}"
            try:
                torch.testing.assert_close(
                    full.detach().resolve_conj().resolve_neg(), e.detach().resolve_conj().resolve_neg(),
                    rtol=1e-4, atol=1e-5, equal_nan=True, check_stride=False,
                )
            except AssertionError as error:
                return f"{what}[{i}]: values differ ({' '.join(str(error).split())[:200]})"
        elif isinstance(e, float) and isinstance(g, float):
            if not (e == g or (e != e and g != g) or abs(e - g) <= 1e-5 + 1e-4 * abs(e)):
                return f"{what}[{i}]: {g!r}, torch gives {e!r}"
        elif e != g and not (isinstance(g, torch.Tensor) and g.numel() == 1 and g.item() == e):
            return f"{what}[{i}]: {g!r}, torch gives {e!r}"
    return None


def _compare_grads(impl: Impl, mesh: Any, expected: Any, got: Any, ref_args: Any, dt_args: Any) -> str | None:
    """Backward with one seeded gradient on both sides; None when every input's gradient agrees."""
    exp_outs = [t for t in tree_flatten(expected)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    got_outs = [t for t in tree_flatten(got)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    ref_inputs = [t for t in tree_flatten(ref_args)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    dt_inputs = [t for t in tree_flatten(dt_args)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    if not exp_outs or not ref_inputs or len(exp_outs) != len(got_outs):
        return None
    torch.manual_seed(1)
    seeds = [torch.randn_like(e.detach().resolve_conj().resolve_neg()) for e in exp_outs]
    try:
        exp_grads = torch.autograd.grad(exp_outs, ref_inputs, seeds, allow_unused=True)
    except Exception:  # noqa: BLE001 - torch has no backward for this sample: nothing to compare
        return None
    dt_seeds = [_seed_like(impl, mesh, s, g) for s, g in zip(seeds, got_outs)]
    got_grads = torch.autograd.grad(got_outs, dt_inputs, dt_seeds, allow_unused=True)
    for i, (e, g) in enumerate(zip(exp_grads, got_grads)):
        if e is None and g is None:
            continue
        e = e if e is not None else torch.zeros_like(ref_inputs[i])
        if g is None:
            if torch.count_nonzero(e.detach()) == 0:
                continue
            return f"grad[{i}]: none, torch gives one"
        problem = _compare(impl, e.detach(), g, f"grad[{i}]")
        if problem is not None:
            return problem
    return None


def _seed_like(impl: Impl, mesh: Any, seed: torch.Tensor, out: Any) -> Any:
    """The gradient ``seed`` for output ``out``: a DTensor in ``out``'s placements (a Partial one takes it replicated)."""
    if not isinstance(out, impl.dtensor_type):
        return seed
    placements = [p if (p.is_shard() or p.is_replicate()) else impl.replicate() for p in out.placements]  # type: ignore[attr-defined]
    return impl.distribute(seed, mesh, [impl.replicate()]).redistribute(out.device_mesh, placements)  # type: ignore[attr-defined]
