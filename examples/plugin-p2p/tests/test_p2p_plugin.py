"""The example plugin is installed, listed, and passes the conformance suite with generic collectives."""

import subprocess
import sys

import spmd
from spmd.comm.registry import backends
from spmd.testing.conformance import BackendConformance


def test_plugin_is_installed_and_has_no_native_collectives():
    entry = backends().get("p2p")
    assert entry.plugin == "p2p"
    assert entry.spec.native_ops() == frozenset()
    assert issubclass(entry.spec.factory, spmd.Backend)


def test_spmd_plugins_lists_it():
    out = subprocess.run([sys.executable, "-m", "spmd", "plugins"], capture_output=True, text=True, check=True).stdout
    assert "spmd-example-p2p" in out and "p2p" in out


class TestP2PConformance(BackendConformance):
    backend = "p2p"
