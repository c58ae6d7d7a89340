"""Porting from torch: docs/porting.md against torch's and spmd's modules, the mirror modules, and a TP script
written for torch that runs on spmd with `torch.distributed` replaced by `spmd` in its import lines."""

from __future__ import annotations

import importlib
import re
import sys
import types
from pathlib import Path

import porting_helpers as h
import pytest

from spmd.errors import NotYetInSpmdError

ROOT = Path(__file__).parent.parent
PAGE = ROOT / "docs" / "porting.md"
TORCH_SCRIPT = ROOT / "examples" / "ports" / "tp_torch.py"
#: The torch modules of the tensor half the page must cover (torch.distributed.<suffix> -> spmd.<suffix>).
MODULES = [
    "device_mesh", "tensor", "tensor.parallel", "tensor.experimental", "tensor.placement_types", "tensor.device_mesh",
    "tensor.debug", "fsdp", "checkpoint",
    "checkpoint.state_dict", "checkpoint.stateful", "pipelining", "_tensor", "_tensor.device_mesh",
]


def torch_public_names(module: types.ModuleType) -> list[str]:
    """The module's ``__all__``; without one, its public classes and functions defined in torch."""
    names = getattr(module, "__all__", None)
    if names is not None:
        return list(names)
    return sorted(
        n for n, v in vars(module).items()
        if not n.startswith("_") and not isinstance(v, types.ModuleType) and str(getattr(v, "__module__", "")).startswith("torch")
    )


def page_rows() -> dict[str, dict[str, tuple[str, str]]]:
    """``{module suffix: {torch name: (status, note)}}`` from the tables of docs/porting.md."""
    rows: dict[str, dict[str, tuple[str, str]]] = {}
    current = None
    for line in PAGE.read_text().splitlines():
        heading = re.match(r"^#+ `torch\.distributed\.([\w.]+)` → `spmd\.([\w.]+)`", line)
        if heading:
            assert heading.group(1) == heading.group(2), line  # the one textual replacement
            current = rows.setdefault(heading.group(1), {})
            continue
        row = re.match(r"^\| `(\w+)` \| (yes|not yet) \|(.*)\|$", line)
        if row:
            assert current is not None, f"a row before any module heading: {line}"
            current[row.group(1)] = (row.group(2), row.group(3).strip())
    return rows


ROWS = page_rows()
CASES = [(m, n) for m in MODULES for n in ROWS.get(m, {})]


def test_the_page_lists_every_public_name_torch_exports():
    for suffix in MODULES:
        torch_module = importlib.import_module(f"torch.distributed.{suffix}")
        listed = ROWS.get(suffix, {})
        missing = [n for n in torch_public_names(torch_module) if n not in listed]
        assert not missing, f"docs/porting.md has no row for torch.distributed.{suffix}.{missing}"
        extra = [n for n in listed if n not in torch_public_names(torch_module)]
        assert not extra, f"docs/porting.md lists torch.distributed.{suffix}.{extra}, which torch does not export"


@pytest.mark.parametrize(("suffix", "name"), CASES, ids=[f"{m}.{n}" for m, n in CASES])
def test_each_row_holds_for_torch_and_spmd(suffix, name):
    status, note = ROWS[suffix][name]
    namespace: dict = {}
    exec(f"from torch.distributed.{suffix} import {name}", namespace)  # the torch name exists
    spmd_line = f"from spmd.{suffix} import {name}"
    if status == "yes":
        exec(spmd_line, namespace)
        return
    assert note, f"the 'not yet' row {suffix}.{name} names no closest spmd way"
    try:
        exec(spmd_line, namespace)
    except NotYetInSpmdError as error:
        assert "not yet in spmd; the closest spmd way is" in str(error), str(error)
    else:
        pytest.fail(f"spmd.{suffix} has {name} now: mark its row in docs/porting.md 'yes'")
    assert not hasattr(importlib.import_module(f"spmd.{suffix}"), name)


def test_a_missing_name_raises_an_import_error_that_names_the_way():
    with pytest.raises(ImportError, match=r"register_sharding is not yet in spmd; the closest spmd way is .*spmd_sharding_rules"):
        from spmd.tensor.experimental import register_sharding  # noqa: F401
    import spmd.tensor.experimental as experimental

    # Outside an import statement a missing name is an AttributeError with the same message, so torch's
    # feature checks (``hasattr(dist.tensor.experimental, "context_parallel")``) answer False, not raise.
    with pytest.raises(AttributeError, match="context_parallel is not yet in spmd; the closest spmd way is"):
        experimental.context_parallel  # noqa: B018
    assert not hasattr(experimental, "context_parallel")
    assert getattr(experimental, "context_parallel", "absent") == "absent"
    with pytest.raises(AttributeError):  # a name torch does not have either stays a plain AttributeError
        experimental.no_such_name  # noqa: B018
    assert not hasattr(experimental, "__wrapped__")  # tools that probe dunders see AttributeError


def test_the_mirror_modules_only_re_export():
    import spmd.device_mesh
    import spmd.mesh
    import spmd.parallel.tp
    import spmd.tensor.parallel

    assert spmd.device_mesh.init_device_mesh is spmd.mesh.init_device_mesh
    assert spmd.tensor.parallel.ColwiseParallel is spmd.parallel.tp.ColwiseParallel
    from spmd._tensor import Replicate, Shard
    from spmd._tensor.device_mesh import init_device_mesh

    assert (Shard, Replicate, init_device_mesh) == (spmd.Shard, spmd.Replicate, spmd.init_device_mesh)


def test_flatten_optimizer_state_dict_round_trips():
    from spmd.checkpoint.state_dict import (
        flatten_optimizer_state_dict,
        unflatten_optimizer_state_dict,
    )

    nested = {
        "state": {"a.weight": {"step": 1.0, "exp_avg": 2.0}, "a.weight.x": {"nested": {"k": 3.0}}},
        "param_groups": [{"lr": 0.1, "params": ["a.weight", "a.weight.x"]}],
    }
    flat = flatten_optimizer_state_dict(nested)
    assert flat == {
        "state.a.weight.step": 1.0, "state.a.weight.exp_avg": 2.0, "state.a.weight.x.nested.k": 3.0,
        "param_groups.a.weight.lr": 0.1, "param_groups.a.weight.x.lr": 0.1,
    }
    back = unflatten_optimizer_state_dict(flat, ["a.weight", "a.weight.x"])
    assert back["state"] == nested["state"]
    assert {fqn: g["lr"] for g in back["param_groups"] for fqn in g["params"]} == {"a.weight": 0.1, "a.weight.x": 0.1}


# -- on 2 ranks, against torch's own DTensor in the same world ---------------------------------------------


def test_implicit_replication_as_torch(spmd_world):
    for r in spmd_world(2, "gloo").run(h.implicit_replication_against_torch, timeout=120):
        assert r["raised_outside"] == ["MixedTensorError", "torch raised"], r
        assert r["placements"] == r["torch_placements"], r
        assert r["diff"] == 0.0 and r["torch_diff"] == 0.0, r


def test_local_map_as_torch(spmd_world):
    for r in spmd_world(2, "gloo").run(h.local_map_against_torch, timeout=120):
        assert r["output"] < 1e-6 and r["torch_output"] < 1e-6, r
        assert r["grads"] < 1e-6, r
        assert r["placements"] == r["torch_placements"] == ["Partial"], r
        assert r["mismatch"] == ["ValueError", "ValueError"], r
        assert r["redistributed"] < 1e-6, r
        assert r["plain"] is True, r


def test_stateful_values_save_and_load_through_their_state_dicts(spmd_world, tmp_path):
    for r in spmd_world(2, "gloo").run(h.stateful_save_load, str(tmp_path / "ckpt"), timeout=120):
        assert r["calls"] == ["state_dict", "state_dict", "load_state_dict"], r
        assert r["restored"] and r["model_restored"] and r["step"] == 7, r


def test_broadcast_from_rank0_as_torch(spmd_world):
    for r in spmd_world(2, "gloo").run(h.broadcast_from_rank0_against_torch, timeout=180):
        assert r["model"] == 0.0 and r["optim"] == 0.0, r
        assert r["vs_torch_model"] == 0.0 and r["vs_torch_optim"] == 0.0, r
        assert r["rank0_only"] == (r["rank"] != 0), r
        assert r["frozen_left_out"], r


def test_torchs_own_broadcast_from_rank0_runs_over_spmd(spmd_world):
    assert spmd_world(2, "gloo").run(h.torch_broadcast_from_rank0_over_spmd, timeout=120) == [True, True]


# -- a torch tensor-parallel script ported by the one replacement --------------------------------------------


def ported(source: str) -> str:
    """The script with ``torch.distributed`` replaced by ``spmd`` in its import lines, and nothing else."""
    lines = []
    for line in source.splitlines():
        if re.match(r"^\s*(import|from)\s+torch\.distributed", line):
            line = line.replace("torch.distributed", "spmd")
        lines.append(line)
    return "\n".join(lines) + "\n"


def test_a_torch_tp_script_runs_on_spmd_after_replacing_its_imports(tmp_path):
    from test_ports import TORCHRUN, close, launch

    source = TORCH_SCRIPT.read_text()
    assert "init_process_group(" not in source and "import spmd" not in source and "from spmd" not in source
    spmd_script = tmp_path / "tp_spmd.py"
    spmd_script.write_text(ported(source))
    assert "from spmd.device_mesh import init_device_mesh" in spmd_script.read_text()
    ours, log = launch(spmd_script, "torchrun", [], [sys.executable, "-m", "spmd", "run"])
    theirs, _ = launch(TORCH_SCRIPT, "torchrun", [], [str(TORCHRUN)], reference=True)
    assert all(r["spmd"] for r in ours) and not any(r["spmd"] for r in theirs), (ours, theirs)
    for a, b in zip(ours, theirs):
        a.pop("spmd"), b.pop("spmd")
    assert close(ours, theirs), f"spmd: {ours}\ntorch: {theirs}"


@pytest.mark.parametrize(("cls_name", "stages_per_rank"), [
    ("ScheduleGPipe", 1), ("Schedule1F1B", 1), ("ScheduleInterleaved1F1B", 2), ("ScheduleInterleavedZeroBubble", 1),
])
def test_pipelining_under_torch_names(spmd_world, cls_name, stages_per_rank):
    results = spmd_world(2, "gloo").run(h.pipelining_torch_names, cls_name, stages_per_rank, 4, timeout=120)
    for r in results:
        assert r["grads"] < 1e-5 and r["losses"] < 1e-5, r
    assert [r["had_losses"] for r in results] == [False, True]


def test_pipelining_says_what_is_not_yet():
    import torch

    import spmd.pipelining as pp

    with pytest.raises(NotYetInSpmdError, match="SplitPoint is not yet in spmd; the closest spmd way is .*split_module"):
        from spmd.pipelining import SplitPoint  # noqa: F401
    with pytest.raises(NotYetInSpmdError, match="args_chunk_spec"):
        pp.ScheduleGPipe(object(), 2, args_chunk_spec=(None,))  # type: ignore[arg-type]
    with pytest.raises(NotYetInSpmdError, match="a stage with 2 inputs"):
        pp.PipelineStage(torch.nn.Linear(2, 2), 0, 1, "cpu", input_args=(torch.zeros(1), torch.zeros(1)))


def test_torchs_private_init_optim_state_imports_from_the_spmd_path_and_does_what_torchs_does():
    """pytorch/examples' FSDP2 checkpoint.py imports ``_init_optim_state`` from torch's state_dict module:
    after the import line is ported it must exist there, and create the same optimizer state as torch's."""
    import torch
    from torch.distributed.checkpoint.state_dict import _init_optim_state as torch_init

    from spmd.checkpoint.state_dict import _init_optim_state

    states = []
    for init in (_init_optim_state, torch_init):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        before = [p.detach().clone() for p in model.parameters()]
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        init(opt)
        assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))  # a step with lr 0
        assert all(p.grad is None for p in model.parameters()) and opt.param_groups[0]["lr"] == 0.1
        states.append(opt.state_dict()["state"])
    ours, theirs = states
    assert ours.keys() == theirs.keys() == {0, 1}
    for k in ours:
        assert ours[k].keys() == theirs[k].keys()
        assert all(torch.equal(ours[k][a], theirs[k][a]) for a in ours[k])
