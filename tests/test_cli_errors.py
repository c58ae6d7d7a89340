"""The spmd command turns a known error into one line naming what exists, with exit status 2, never a traceback."""

from __future__ import annotations

import torch

from spmd.cli import main


def test_an_unknown_schedule_is_one_line_listing_the_schedules(capsys):
    assert main(["pipeline", "show", "foo", "--stages", "2", "--microbatches", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown pipeline schedule 'foo'" in err and "1f1b" in err
    assert "Traceback" not in err


def test_inspect_of_a_torch_file_points_to_import_torch(tmp_path, capsys):
    path = tmp_path / "train_final.pt"
    torch.save({"w": torch.zeros(2)}, path)
    assert main(["checkpoint", "inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"spmd checkpoint import-torch {path} DIR" in err
