"""spmd.settings: one typed object for every SPMD_* variable, its table in docs/settings.md, and named errors."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from spmd import settings
from spmd.errors import SettingError

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "settings.md"


def _table(section: str) -> list[str]:
    """The variables a markdown table of docs/settings.md lists under the heading ``section``, in order."""
    text = DOC.read_text()
    body = text.split(f"\n{section}\n", 1)[1]
    body = re.split(r"\n#{2,3} ", body, maxsplit=1)[0]
    return re.findall(r"^\| `(SPMD_[A-Z0-9_]+)` \|", body, re.M)


def test_the_doc_table_and_the_settings_object_list_the_same_variables():
    documented = _table("## The kernel's settings")
    assert documented == [s.variable for s in settings.SETTINGS]
    assert [s.field for s in settings.SETTINGS] == [f.name for f in dataclasses.fields(settings.Settings)]


def test_the_kernel_reads_no_spmd_variable_outside_settings():
    """Every SPMD_* read in core/spmd goes through spmd.settings (writes, for children, are not reads)."""
    reads = re.compile(r"""environ\.get\(\s*["']SPMD_|getenv\(\s*["']SPMD_|environ\[["']SPMD_\w+["']\](?!\s*=)""")
    offenders = [f"{path.relative_to(ROOT)}:{n}" for path in (ROOT / "core" / "spmd").rglob("*.py")
                 for n, line in enumerate(path.read_text().splitlines(), 1) if reads.search(line)]
    assert offenders == []


def test_each_plugins_variables_are_in_the_table_under_that_plugin():
    for folder in sorted((ROOT / "plugins").iterdir()):
        sources = [p for p in folder.glob("spmd_*/**/*.py")]
        used = {v for p in sources for v in re.findall(r"[\"'`](SPMD_[A-Z0-9_]+)", p.read_text())}
        used -= {s.variable for s in settings.SETTINGS}  # a plugin naming a kernel setting (SPMD_SOCKET_IFNAME)
        if used:
            assert sorted(used) == sorted(_table(f"### spmd-{folder.name}")), folder.name


def test_unset_and_empty_variables_give_the_defaults():
    assert settings.from_environ({}) == settings.Settings()
    assert settings.from_environ({s.variable: " " for s in settings.SETTINGS}) == settings.Settings()


def test_values_are_parsed_to_their_types():
    read = settings.from_environ({"SPMD_TIMEOUT": "2.5", "SPMD_WATCHDOG": "off", "SPMD_DESYNC_CHECK": "YES",
                                  "SPMD_FLIGHT_RECORDER": "0", "SPMD_BLOCK_PLUGINS": " a, b ,,", "SPMD_RUN_ID": "job7"})
    assert read.timeout == 2.5 and read.watchdog is False and read.desync_check is True
    assert read.flight_recorder == 0 and read.block_plugins == {"a", "b"} and read.run_id == "job7"


@pytest.mark.parametrize(("variable", "text"), [("SPMD_TIMEOUT", "soon"), ("SPMD_TIMEOUT", "0"), ("SPMD_WATCHDOG", "2"),
                                                ("SPMD_FLIGHT_RECORDER", "-1"), ("SPMD_WATCHDOG_INTERVAL", "1s")])
def test_a_bad_value_is_a_named_error_saying_what_the_variable_accepts(variable, text):
    accepts = next(s.accepts for s in settings.SETTINGS if s.variable == variable)
    with pytest.raises(SettingError, match=re.escape(f"{variable}={text!r}: give {accepts}")):
        settings.from_environ({variable: text})


def test_settings_are_read_once_and_again_on_refresh(spmd_setenv, monkeypatch):
    spmd_setenv("SPMD_WATCHDOG_INTERVAL", "0.25")
    assert settings.current().watchdog_interval == 0.25
    monkeypatch.setenv("SPMD_WATCHDOG_INTERVAL", "0.5")
    assert settings.current().watchdog_interval == 0.25  # read once: a later change waits for a refresh
    assert settings.refresh().watchdog_interval == 0.5 == settings.current().watchdog_interval


def test_a_malformed_variable_never_fails_the_import_and_init_names_it():
    """A module-level default is read at ``import spmd``: a bad value there must not turn every import (and the
    ``spmd`` command itself) into a traceback; ``spmd.init`` reads the settings again and raises the named error."""
    import os
    import subprocess
    import sys

    script = (
        "import spmd\n"
        "from spmd.errors import SettingError\n"
        "try:\n"
        "    spmd.init('gloo', rank=0, world_size=1, init_method='tcp://127.0.0.1:1')\n"
        "except SettingError as error:\n"
        "    print('init:', error)\n"
    )
    for variable in ("SPMD_FLIGHT_RECORDER", "SPMD_DESYNC_CHECK", "SPMD_HISTORY_CHECK"):
        env = {**os.environ, variable: "2x"}
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.startswith(f"init: {variable}='2x': give "), done.stdout
