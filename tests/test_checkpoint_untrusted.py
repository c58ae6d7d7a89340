"""A checkpoint directory is untrusted input: a real checkpoint, saved by 2 ranks, then tampered with.

Every tampering (paths out of the directory, links, FIFOs, a huge metadata
file, chunks that overlap or leave holes, duplicate keys, a relabelled
dtype, wrong types, deep nesting) must end in one CheckpointError naming the
file and field, within a second, with no byte of a secret file planted
beside the checkpoint in any loaded tensor or consolidated output; through
load (file storage, fsspec's local file system, 2 ranks) and the CLI.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import checkpoint_helpers as h
import pytest
import torch

import spmd.checkpoint as dcp
from spmd.checkpoint.filesystem import FileStorage
from spmd.checkpoint.metadata import METADATA_FILE
from spmd.checkpoint.schema import MAX_METADATA_BYTES
from spmd.checkpoint.untrusted import MAX_NESTING
from spmd.cli import main
from spmd.errors import SpmdError

SECRET = b"TOP-SECRET-BYTES" * 64
#: How long a refusal may take; and how long a call may run before the test calls it blocked.
BOUND_S = 1.0
HANG_S = 15.0
GIB = 2**30


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, spmd_world_pool) -> Path:
    path = tmp_path_factory.mktemp("untrusted") / "pristine"
    spmd_world_pool.get(2, "gloo").run(h.save_small_on_two, str(path), timeout=120)
    return path


@pytest.fixture
def ck(pristine, tmp_path) -> Any:
    """A fresh copy of the saved checkpoint at tmp_path/ck, the secret at tmp_path/SECRET (its ``../SECRET``)."""
    (tmp_path / "SECRET").write_bytes(SECRET)
    path = tmp_path / "ck"
    shutil.copytree(pristine, path)
    yield path
    _release_fifos(tmp_path)


def _release_fifos(root: Path) -> None:
    """Open every FIFO under ``root`` for writing once, so a reader a regression left blocked gets EOF."""
    for directory, _, names in os.walk(root):
        for name in names:
            target = os.path.join(directory, name)
            if stat.S_ISFIFO(os.lstat(target).st_mode):
                try:
                    os.close(os.open(target, os.O_WRONLY | os.O_NONBLOCK))
                except OSError:
                    pass


def bounded(fn: Callable[..., Any], *args: Any) -> dict[str, Any]:
    """Run ``fn(*args)`` in a thread: its value or error and its seconds; fail if it is still running after HANG_S."""
    out: dict[str, Any] = {}

    def run() -> None:
        start = time.perf_counter()
        try:
            out["value"] = fn(*args)
        except BaseException as error:  # noqa: BLE001 - handed to the test
            out["error"] = error
        out["seconds"] = time.perf_counter() - start

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(HANG_S)
    assert not thread.is_alive(), f"{fn.__name__}{args} still running after {HANG_S} s: it blocks"
    return out


# -- tampering ---------------------------------------------------------------------------------------------


def _meta(ck: Path) -> dict[str, Any]:
    return json.loads((ck / METADATA_FILE).read_text())


def _rank_file(ck: Path, rank: int = 0) -> Path:
    return ck / _meta(ck)["data_dir"] / f"rank-{rank:05d}.safetensors"


def _edit(change: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def tamper(ck: Path) -> None:
        doc = _meta(ck)
        change(doc)
        (ck / METADATA_FILE).write_text(json.dumps(doc))

    return tamper


def _w(doc: dict[str, Any], i: int = 0) -> dict[str, Any]:
    return doc["tensors"]["w"]["chunks"][i]


def _point_w_at(file: str) -> Callable[[Path], None]:
    def change(doc: dict[str, Any]) -> None:
        _w(doc).update(file=file, begin=0, end=24)  # rows 0-1 of w: 24 bytes, the secret's first

    return _edit(change)


def _claim_huge(file: str | None) -> Callable[[Path], None]:
    """``ids`` as a 1.5 GiB U8 tensor in ``file`` (None: where it really is, a file of a few hundred bytes)."""

    def change(doc: dict[str, Any]) -> None:
        chunk = doc["tensors"]["ids"]["chunks"][0]
        n = 3 * GIB // 2
        doc["tensors"]["ids"] = {"shape": [n], "dtype": "U8", "placements": "-", "chunks": [
            {**chunk, "offsets": [0], "sizes": [n], "file": file or chunk["file"], "begin": 0, "end": n}]}

    return _edit(change)


def _move_out_and_link(which: Callable[[Path], Path]) -> Callable[[Path], None]:
    def tamper(ck: Path) -> None:
        inside = which(ck)
        outside = ck.parent / f"moved-{inside.name}"
        inside.rename(outside)
        inside.symlink_to(outside)  # the same, valid content, now behind a link

    return tamper


def _link_rank_file_to_secret(ck: Path) -> None:
    target = _rank_file(ck)
    target.unlink()
    target.symlink_to(ck.parent / "SECRET")


def _fifo(which: Callable[[Path], Path]) -> Callable[[Path], None]:
    def tamper(ck: Path) -> None:
        target = which(ck)
        target.unlink()
        os.mkfifo(target)

    return tamper


def _huge_metadata(ck: Path) -> None:
    with open(ck / METADATA_FILE, "r+b") as f:
        f.truncate(3 * GIB)  # sparse: no disk, but a 3 GiB file


def _duplicate_key(ck: Path) -> None:
    text = (ck / METADATA_FILE).read_text()
    text = text.replace('"format": "spmd-checkpoint",', '"format": "spmd-checkpoint", "data_dir": "data-000000000000",', 1)
    (ck / METADATA_FILE).write_text(text)


def _nest(depth: int) -> Callable[[Path], None]:
    def tamper(ck: Path) -> None:
        text = (ck / METADATA_FILE).read_text()
        (ck / METADATA_FILE).write_text(text.replace('"values": {', '"values": {"deep": ' + "[" * depth + "]" * depth + ", ", 1))

    return tamper


def _truncate_rank_file(ck: Path) -> None:
    with open(_rank_file(ck), "r+b") as f:
        f.truncate(100)


def _relabel(doc: dict[str, Any]) -> None:
    doc["tensors"]["w"]["dtype"] = "I32"


#: name -> (tamper, what the error must say).
CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "chunk file ../SECRET": (_point_w_at("../SECRET"), "refusing a path"),
    "chunk file ../../../../etc/passwd": (_point_w_at("../../../../etc/passwd"), "refusing a path"),
    "chunk file /etc/passwd": (_point_w_at("/etc/passwd"), "refusing a path"),
    "chunk file data-dir/../../SECRET": (lambda ck: _point_w_at(f"{_meta(ck)['data_dir']}/../../SECRET")(ck), "refusing a path"),
    "data_dir ..": (_edit(lambda doc: doc.update(data_dir="..")), "data_dir"),
    "1.5 GiB from /dev/zero": (_claim_huge("../" * 32 + "dev/zero"), "refusing a path"),
    "1.5 GiB claimed of a small file": (_claim_huge(None), "outside the file's data"),
    "rank file a symlink": (_move_out_and_link(_rank_file), "symbolic link"),
    "rank file a symlink to the secret": (_link_rank_file_to_secret, "symbolic link"),
    "data dir a symlink": (_move_out_and_link(lambda ck: _rank_file(ck).parent), "symbolic link"),
    "metadata.json a symlink": (_move_out_and_link(lambda ck: ck / METADATA_FILE), "symbolic link"),
    "metadata.json a FIFO": (_fifo(lambda ck: ck / METADATA_FILE), "FIFO"),
    "rank file a FIFO": (_fifo(_rank_file), "FIFO"),
    "3 GiB metadata.json": (_huge_metadata, f"more than the {MAX_METADATA_BYTES}"),
    "two chunks on rows 0-1, none on 2-3": (_edit(lambda doc: _w(doc, 1).update(offsets=[0, 0])), "do not tile"),
    "a chunk twice": (_edit(lambda doc: doc["tensors"]["w"]["chunks"].append(_w(doc))), "overlap"),
    "chunk outside the shape": (_edit(lambda doc: _w(doc, 1).update(offsets=[3, 0])), "reaches element 5 of dimension 0"),
    "duplicate key": (_duplicate_key, "'data_dir' appears twice"),
    "dtype relabelled F32 -> I32": (_edit(_relabel), "header stores 'w@0,0' with dtype 'F32'"),
    "unknown dtype F128": (_edit(lambda doc: doc["tensors"]["w"].update(dtype="F128")), r"dtype is 'F128', not one of"),
    "chunk without file": (_edit(lambda doc: _w(doc).pop("file")), r"chunks\[0\].file is missing"),
    "version a string": (_edit(lambda doc: doc.update(version="2")), "version is '2', not an integer"),
    "tensors a list": (_edit(lambda doc: doc.update(tensors=[])), "tensors is .*, not an object"),
    "shape of strings": (_edit(lambda doc: doc["tensors"]["w"].update(shape=["4", 3])), r"shape\[0\] is '4'"),
    "shape of booleans": (_edit(lambda doc: doc["tensors"]["w"].update(shape=[True, 3])), r"shape\[0\] is True"),
    "negative offset": (_edit(lambda doc: _w(doc).update(begin=-8, end=16)), r"chunks\[0\].begin is -8"),
    "nesting 100000 deep": (_nest(100_000), f"deeper than {MAX_NESTING}"),
    "nesting 100 deep": (_nest(100), f"deeper than {MAX_NESTING}"),
    "rank file truncated": (_truncate_rank_file, "safetensors header claims|outside the file's data"),
}


#: The cases as test ids without spaces or slashes (``-k rank-file-a-FIFO``).
IDS = [re.sub(r"[^A-Za-z0-9.]+", "-", case).strip("-") for case in CASES]


def _target() -> dict[str, Any]:
    """What a load fills: ``ids`` None, so it becomes a new tensor of whatever shape the checkpoint claims."""
    return {"w": torch.zeros(4, 3), "ids": None, "step": 0, "cfg": {"lr": 0.0}}


def _held(state: dict[str, Any]) -> bytes:
    return b"".join(t.contiguous().numpy().tobytes() for t in (state["w"], state["ids"]) if isinstance(t, torch.Tensor))


def _refused(ck: Path, match: str, url: str) -> None:
    state = _target()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = bounded(dcp.load, state, url)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) / 1024  # Linux: KiB
    error = out.get("error")
    assert isinstance(error, dcp.CheckpointError) and isinstance(error, SpmdError), out
    assert re.search(match, str(error)), str(error)
    assert "\n" not in str(error), str(error)
    assert out["seconds"] < BOUND_S, out
    assert SECRET[:8] not in _held(state) and b"root:" not in _held(state)
    assert grown_mib < 512, f"peak memory grew {grown_mib:.0f} MiB while refusing"


# -- the checks -------------------------------------------------------------------------------------------


def test_the_untouched_copy_loads_and_consolidates(ck, tmp_path, capsys):
    """The harness itself: without tampering the copy loads and consolidates to the saved values."""
    from safetensors.torch import load_file

    state = _target()
    dcp.load(state, checkpoint_id=str(ck))
    want = h.small_state()
    assert torch.equal(state["w"], want["w"]) and torch.equal(state["ids"], want["ids"]) and state["cfg"] == want["cfg"]
    assert _held(state) == want["w"].numpy().tobytes() + want["ids"].numpy().tobytes()
    assert len(_meta(ck)["tensors"]["w"]["chunks"]) == 2 and _rank_file(ck, 1).is_file()
    assert main(["checkpoint", "consolidate", str(ck), str(tmp_path / "full.safetensors")]) == 0
    assert torch.equal(load_file(tmp_path / "full.safetensors")["w"], want["w"])
    assert main(["checkpoint", "inspect", str(ck)]) == 0


@pytest.mark.parametrize("case", list(CASES), ids=IDS)
def test_load_refuses(ck, case):
    tamper, match = CASES[case]
    tamper(ck)
    _refused(ck, match, str(ck))


@pytest.mark.parametrize("case", list(CASES), ids=IDS)
def test_load_through_fsspec_local_refuses(ck, case):
    pytest.importorskip("fsspec", reason="fsspec is not installed: its storage is not loaded")
    tamper, match = CASES[case]
    tamper(ck)
    _refused(ck, match, f"local://{ck}")


@pytest.mark.parametrize("command", ["consolidate", "inspect"])
@pytest.mark.parametrize("case", list(CASES), ids=IDS)
def test_cli_refuses_in_one_line(ck, tmp_path, capsys, case, command):
    tamper, match = CASES[case]
    tamper(ck)
    out = tmp_path / "full.safetensors"
    args = ["checkpoint", command, str(ck), *([str(out)] if command == "consolidate" else [])]
    result = bounded(main, args)
    captured = capsys.readouterr()
    assert result.get("value") == 2, (result, captured)
    assert result["seconds"] < BOUND_S, result
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err, captured.err
    assert captured.err.startswith(f"spmd checkpoint {command}: ") and re.search(match, captured.err)
    assert not out.exists() or SECRET[:8] not in out.read_bytes()


def test_two_ranks_refuse_a_symlinked_data_dir_and_a_path_out(spmd_world, pristine, ck, tmp_path):
    world = spmd_world(2, "gloo")
    _move_out_and_link(lambda c: _rank_file(c).parent)(ck)
    for r in world.run(h.load_small_on_two, str(ck), SECRET, timeout=60):
        assert r["error"] and "symbolic link" in r["error"] and r["seconds"] < BOUND_S and not r["secret_seen"], r
    other = tmp_path / "other"
    shutil.copytree(pristine, other)
    _point_w_at("../SECRET")(other)
    for r in world.run(h.load_small_on_two, str(other), SECRET, timeout=60):
        assert r["error"] and "refusing a path" in r["error"] and not r["secret_seen"], r


class Evil:
    """Unpickling it would run a shell command."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("echo pwned",))


def test_storages_refuse_a_path_out_of_the_root_and_a_negative_offset(ck):
    """Below the metadata's checks, the storages themselves refuse a name that leaves the root."""
    storages: list[Any] = [FileStorage(str(ck))]
    try:
        import fsspec

        from spmd.checkpoint.fsspec_storage import FsspecStorage
    except ImportError:
        pass
    else:
        memory = fsspec.filesystem("memory")
        memory.pipe_file("/spmd-untrusted/SECRET", SECRET)
        memory.pipe_file(f"/spmd-untrusted/ck/{METADATA_FILE}", (ck / METADATA_FILE).read_bytes())
        storages += [FsspecStorage(f"local://{ck}"), FsspecStorage("memory://spmd-untrusted/ck")]
    for storage in storages:
        assert bytes(storage.read(METADATA_FILE)) == (ck / METADATA_FILE).read_bytes()  # what is there reads
        for path in ("../SECRET", "/etc/passwd", "data-0/../../SECRET", "", "a//b", ".hidden"):
            with pytest.raises(dcp.CheckpointError, match="not a plain name"):
                storage.read(path)
            with pytest.raises(dcp.CheckpointError, match="not a plain name"):
                storage.size(path)
        with pytest.raises(dcp.CheckpointError, match="outside the file"):
            storage.read(METADATA_FILE, -8, 8)
        with pytest.raises(dcp.CheckpointError, match="outside the file"):
            storage.read_into(METADATA_FILE, -8, memoryview(bytearray(8)))


def test_an_fsspec_memory_checkpoint_refuses_a_relabelled_dtype():
    pytest.importorskip("fsspec", reason="fsspec is not installed: its storage is not loaded")
    import fsspec

    url = "memory://spmd-untrusted/relabelled"
    dcp.save({"w": torch.arange(6.0)}, checkpoint_id=url)
    fs = fsspec.filesystem("memory")
    doc = json.loads(fs.cat_file("/spmd-untrusted/relabelled/metadata.json"))
    doc["tensors"]["w"]["dtype"] = "I32"
    fs.pipe_file("/spmd-untrusted/relabelled/metadata.json", json.dumps(doc).encode())
    with pytest.raises(dcp.CheckpointError, match="header stores 'w' with dtype 'F32'"):
        dcp.load({"w": torch.zeros(6)}, checkpoint_id=url)


def test_cli_in_a_process_no_traceback_no_hang(ck, tmp_path):
    """`spmd checkpoint inspect` of a FIFO metadata.json, `import-torch` of a malicious pickle: one line, exit 2."""
    _fifo(lambda c: c / METADATA_FILE)(ck)
    torch.save({"w": Evil()}, tmp_path / "evil.pt")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for args, match in (
        (["inspect", str(ck)], "is a FIFO"),
        (["import-torch", str(tmp_path / "evil.pt"), str(tmp_path / "imported")], "was refused"),
    ):
        proc = subprocess.run([sys.executable, "-m", "spmd", "checkpoint", *args], capture_output=True, text=True,
                              timeout=60, env=env)
        last = proc.stderr.splitlines()[-1]  # (import-torch says first that it unpickles)
        assert proc.returncode == 2 and last.startswith("spmd checkpoint") and re.search(match, last), proc
        assert "Traceback" not in proc.stderr and "pwned" not in proc.stdout, proc
    assert not (tmp_path / "imported").exists()


def test_import_torch_refuses_a_malicious_pickle_and_garbage_by_name(tmp_path, capsys):
    torch.save({"w": Evil()}, tmp_path / "evil.pt")
    (tmp_path / "garbage.pt").write_bytes(b"not a torch file")
    for name, match in (("evil.pt", "was refused.*posix.system"), ("garbage.pt", "was refused|not a readable torch.save file")):
        assert main(["checkpoint", "import-torch", str(tmp_path / name), str(tmp_path / "imported")]) == 2
        err = capsys.readouterr().err.splitlines()
        assert err[-1].startswith("spmd checkpoint import-torch: ") and re.search(match, err[-1]), err
        assert "Traceback" not in "\n".join(err) and not (tmp_path / "imported").exists()
