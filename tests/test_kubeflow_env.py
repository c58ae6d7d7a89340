"""Kubeflow Trainer's PET_* variables: `spmd run` reads them as torchrun does; `python train.py` alone in a pod joins."""

from __future__ import annotations

import argparse
import socket

import pytest
import torch
from torch.distributed.run import get_args_parser

import spmd
from spmd.launch.args import build_parser, to_config
from spmd.launch.environments import detect_launch

#: What Kubeflow Trainer's torch runtime sets in the pod of node 1 of 2.
PET = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "4", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "trainer-node-0-0.job",
       "PET_MASTER_PORT": "29400"}
FLAGS = ("nnodes", "nproc_per_node", "node_rank", "master_addr", "master_port", "max_restarts", "module")


def _pet(monkeypatch, values: dict[str, str]) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "KUBERNETES_SERVICE_HOST"):
        monkeypatch.delenv(name, raising=False)
    for name, value in values.items():
        monkeypatch.setenv(name, value)


def test_spmd_run_reads_pet_variables_as_torchrun_does(monkeypatch):
    _pet(monkeypatch, {**PET, "PET_MAX_RESTARTS": "3", "PET_MODULE": "1"})
    ours = build_parser(argparse.ArgumentParser()).parse_args(["train"])
    torchs = get_args_parser().parse_args(["train"])  # torchrun's own parser, reading the same environment
    assert {f: str(getattr(ours, f)) for f in FLAGS} == {f: str(getattr(torchs, f)) for f in FLAGS}
    config = to_config(ours)
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node, config.node_rank) == (2, 2, 4, 1)
    assert config.rdzv_endpoint == "trainer-node-0-0.job:29400" and config.max_restarts == 3 and config.module
    flag_wins = build_parser(argparse.ArgumentParser()).parse_args(["--nproc-per-node", "2", "train"])
    assert to_config(flag_wins).nproc_per_node == 2


def test_a_pet_switch_that_is_not_0_or_1_is_named(monkeypatch):
    _pet(monkeypatch, {"PET_STANDALONE": "yes"})
    with pytest.raises(SystemExit, match=r"PET_STANDALONE='yes' stands for --standalone: use 1 \(on\) or 0"):
        build_parser(argparse.ArgumentParser())


def test_one_process_per_pod_joins_from_pet_variables(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _pet(monkeypatch, {"PET_NNODES": "1", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": "0",
                       "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(port)})
    name, info = detect_launch()
    assert name == "kubeflow-trainer" and (info.rank, info.world_size, info.master_port) == (0, 1, port)
    spmd.init("gloo")
    try:
        t = torch.ones(2)
        spmd.all_reduce(t)
        assert (spmd.get_rank(), spmd.get_world_size(), t.tolist()) == (0, 1, [1.0, 1.0])
    finally:
        spmd.destroy_process_group()


def test_several_processes_per_pod_without_a_launcher_is_a_named_error(monkeypatch):
    _pet(monkeypatch, {**PET, "PET_NODE_RANK": "0"})
    with pytest.raises(spmd.SpmdError, match=r"PET_NPROC_PER_NODE=4, .*run `spmd run train.py` in the pod"):
        spmd.init("gloo")
    assert not spmd.is_initialized()
