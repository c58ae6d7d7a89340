"""Throwaway TLS certificates for a test etcd: a CA, a server certificate for 127.0.0.1 (and as etcd's gateway client), a client certificate.

Made with the ``openssl`` command (no Python crypto package needed); EC keys,
valid one day. For tests only: the CA's key sits beside its certificate.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EtcdCertificates:
    """PEM files: the CA, the server's certificate and key, a client's certificate and key."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    done = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed: {done.stderr[-1000:]}")


def _signed(folder: Path, name: str, subject: str, extensions: str) -> None:
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", "-subj", subject, cwd=folder)
    (folder / f"{name}.ext").write_text(extensions)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-days", "1",
             "-out", f"{name}.pem", "-extfile", f"{name}.ext", cwd=folder)


def make_certificates(folder: Path) -> EtcdCertificates:
    """Write a CA and certificates signed by it into ``folder``; RuntimeError if openssl is missing or fails."""
    if shutil.which("openssl") is None:
        raise RuntimeError("no openssl command to make test certificates with")
    folder.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", "ca.key",
             "-out", "ca.pem", "-days", "1", "-subj", "/CN=spmd-test-ca", cwd=folder)
    # No CommonName in either: with --client-cert-auth and auth enabled, etcd's JSON gateway answers HTTP 400 to a
    # client certificate with one (a CommonName names an etcd user, which the gateway cannot pass on); and the
    # gateway calls etcd's gRPC side with the server's certificate, which therefore needs clientAuth as well.
    _signed(folder, "server", "/O=spmd-test-etcd", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n")
    _signed(folder, "client", "/O=spmd-test-client", "extendedKeyUsage=clientAuth\n")
    return EtcdCertificates(folder / "ca.pem", folder / "server.pem", folder / "server.key", folder / "client.pem", folder / "client.key")
