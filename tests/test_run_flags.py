"""`spmd run` takes every torchrun flag; its errors show its own usage; `spmd --version`."""

from __future__ import annotations

import argparse
import subprocess
import sys

from torch.distributed.run import get_args_parser

from spmd.launch.args import build_parser, to_config


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}


def test_every_torchrun_flag_is_accepted():
    ours = _flags(build_parser(argparse.ArgumentParser()))
    missing = sorted(_flags(get_args_parser()) - ours)
    assert missing == [], f"spmd run lacks torchrun's {missing}"


def test_master_addr_and_port_are_torchruns_static_rendezvous():
    ns = build_parser(argparse.ArgumentParser()).parse_args(["--nnodes", "2", "--master-addr", "node0", "--master-port", "1234", "--rdzv-conf", "join_timeout=7", "--shutdown-timeout", "9", "x.py"])
    config = to_config(ns)
    assert config.rdzv_endpoint == "node0:1234" and not config.standalone and config.master_addr == "node0"
    assert config.rdzv_timeout == 7 and config.stop_grace == 9


def test_a_bad_flag_shows_spmd_runs_usage_and_version_is_printed():
    out = subprocess.run([sys.executable, "-m", "spmd", "run", "--no-such-flag", "x.py"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "usage: spmd run" in out.stderr and "--no-such-flag" in out.stderr
    version = subprocess.run([sys.executable, "-m", "spmd", "--version"], capture_output=True, text=True, timeout=60)
    assert version.returncode == 0 and version.stdout.startswith("spmd ")
