"""`spmd run` forwarding worker output: chunks as written, whole lines, --tee prefixes, the failure summary's tail."""

from __future__ import annotations

import io
import os
import threading
import time

from launch_helpers import wait_for


def test_tee_prefixes_each_line_once():
    """torch.distributed's excepthook already writes ``[rank0]: `` before each traceback line of a torch-started
    world; the agent's --tee prefix is not added again (it printed ``[rank0]: [rank0]: ``)."""
    from spmd.launch.workers import _Sink

    console = io.BytesIO()
    read, write = os.pipe()
    with os.fdopen(write, "wb") as w:
        w.write(b"[rank0]: Traceback (most recent call last):\nplain line\n")
    with os.fdopen(read, "rb") as r:
        _Sink(console, b"[rank0]: ", None, None).pump(r)
    assert console.getvalue() == b"[rank0]: Traceback (most recent call last):\n[rank0]: plain line\n"


class _Console:
    """A console that records what reached it, and when something first did."""

    def __init__(self):
        self.data = bytearray()
        self.got = threading.Event()

    def write(self, data):
        self.data += data
        self.got.set()
        return len(data)

    def flush(self):
        pass


def test_a_progress_bar_reaches_the_console_as_it_moves(tmp_path):
    """tqdm redraws one line with \\r and writes \\n only at the end: each update is forwarded as it comes,
    to the console (prefixed at each redraw under --tee) and to the log file (nothing showed before the \\n)."""
    from spmd.launch.workers import _Sink

    console = _Console()
    log = open(tmp_path / "stderr.log", "wb")  # noqa: SIM115 - the sink closes it
    read, write = os.pipe()
    sink = _Sink(console, b"[rank0]: ", log, None)
    with os.fdopen(read, "rb") as r, os.fdopen(write, "wb", buffering=0) as w:
        thread = threading.Thread(target=sink.pump, args=(r,), daemon=True)
        thread.start()
        w.write(b"  0%|          | 0/10")
        assert console.got.wait(30), "the first update never reached the console"
        w.write(b"\r 10%|#         | 1/10")
        wait_for(lambda: b"1/10" in console.data, 30, "the second update")
        w.write(b"\r100%|##########| 10/10\n")
        w.close()
        thread.join(30)
    assert bytes(console.data) == b"[rank0]:   0%|          | 0/10\r[rank0]:  10%|#         | 1/10\r[rank0]: 100%|##########| 10/10\n"
    assert (tmp_path / "stderr.log").read_bytes() == b"  0%|          | 0/10\r 10%|#         | 1/10\r100%|##########| 10/10\n"


def test_a_line_written_in_two_flushes_reaches_the_console_whole():
    """A worker's stdout into a pipe is flushed in 8 KiB blocks, which cut lines: the console gets each
    line in one write, so two ranks' lines never mix mid-line (only a line left unfinished for
    PARTIAL_LINE_S is forwarded as is)."""
    from spmd.launch.workers import _Sink

    writes: list[bytes] = []

    class Recording(_Console):
        def write(self, data):
            writes.append(bytes(data))
            return super().write(data)

    read, write = os.pipe()
    sink = _Sink(Recording(), b"[rank1]: ", None, None)
    with os.fdopen(read, "rb") as r, os.fdopen(write, "wb", buffering=0) as w:
        thread = threading.Thread(target=sink.pump, args=(r,), daemon=True)
        thread.start()
        w.write(b"step 1 loss 0.5\nstep 2 lo")  # a block flushed in the middle of a line
        time.sleep(0.02)
        w.write(b"ss 0.4\n")
        w.close()
        thread.join(30)
    assert b"".join(writes) == b"[rank1]: step 1 loss 0.5\n[rank1]: step 2 loss 0.4\n"
    assert all(chunk.endswith(b"\n") for chunk in writes), writes


def test_a_huge_line_without_newline_is_not_kept_whole_for_the_summary(tmp_path):
    """A worker writes 1 MiB with no newline, then fails: the log file gets it all, the tail kept for the failure
    summary only each line's end (the whole 'line' was held, twice, and went into the summary)."""
    import collections

    from spmd.launch.workers import TAIL_LINE_BYTES, _last_traceback, _Sink

    tail: collections.deque = collections.deque(maxlen=40)
    blob = b"x" * (1 << 20)
    read, write = os.pipe()
    with os.fdopen(write, "wb") as w:
        threading.Thread(target=lambda: (w.write(blob + b"\nTraceback (most recent call last):\nValueError: boom\n"), w.close()), daemon=True).start()
        with os.fdopen(read, "rb") as r, open(tmp_path / "stderr.log", "wb") as log:
            _Sink(None, b"", log, tail).pump(r)
    assert (tmp_path / "stderr.log").stat().st_size == len(blob) + 53
    assert [len(line) for line in tail] == [TAIL_LINE_BYTES, 34, 16]
    assert _last_traceback(list(tail)) == "Traceback (most recent call last):\nValueError: boom"


class _Chunks(io.RawIOBase):
    """A stream that yields the given chunks, one per read."""

    def __init__(self, chunks):
        self.chunks = list(chunks)

    def readable(self):
        return True

    def readinto(self, buffer):
        if not self.chunks:
            return 0
        chunk = self.chunks.pop(0)
        buffer[: len(chunk)] = chunk
        return len(chunk)


def test_tee_prefixes_line_starts_however_the_output_is_cut_into_chunks():
    """A line that already carries the prefix (torch's excepthook) is recognised even when a read ends inside it."""
    from spmd.launch.workers import _Sink

    text = b"[rank0]: Traceback (most recent call last):\n\nplain [rank0]: \r\nbar 1\rbar 2\r[rank0]: x\n[rank"
    expected = b"[rank0]: Traceback (most recent call last):\n[rank0]: \n[rank0]: plain [rank0]: \r\n[rank0]: bar 1\r[rank0]: bar 2\r[rank0]: x\n[rank0]: [rank"
    for size in (1, 2, 3, 5, 8, 9, 10, len(text)):
        console = _Console()
        stream = io.BufferedReader(_Chunks(text[i:i + size] for i in range(0, len(text), size)))
        _Sink(console, b"[rank0]: ", None, None).pump(stream)
        assert bytes(console.data) == expected, size
