"""How ``spmd run --rdzv-backend etcd`` reaches a secured etcd: https with a CA and client certificate, and a user.

Read from ``--rdzv-conf`` with the keys of torch's etcd rendezvous
(``protocol=https,cacert=CA.pem,cert=CLIENT.pem,key=CLIENT-KEY.pem``) and two
of spmd's: ``user=NAME`` and ``password_file=PATH``. The password comes from
that file or ``$SPMD_ETCD_PASSWORD``, never from the command line, which every
user of the machine can read in ``ps``.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from spmd import settings
from spmd.errors import SpmdError

#: The environment variable that holds the etcd user's password (or use ``password_file=``).
PASSWORD_ENV = "SPMD_ETCD_PASSWORD"
#: The ``--rdzv-conf`` keys read here.
KEYS = ("protocol", "cacert", "cert", "key", "user", "password_file")


@dataclass(frozen=True)
class EtcdSecurity:
    """TLS files and credentials for one etcd cluster; the default is plain http without a user."""

    https: bool = False
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = None

    @property
    def scheme(self) -> str:
        return "https" if self.https else "http"

    def ssl_context(self) -> ssl.SSLContext | None:
        """The context for https connections (the CA, else the system's; the client certificate if any); None for http."""
        if not self.https:
            return None
        try:
            context = ssl.create_default_context(cafile=self.cacert)
            if self.cert:
                context.load_cert_chain(self.cert, self.key)
        except (OSError, ssl.SSLError) as error:
            raise SpmdError(f"--rdzv-conf cacert={self.cacert} cert={self.cert} key={self.key}: cannot load them ({error}); "
                            "name PEM files this user can read") from error
        return context


def security_from_conf(conf: Mapping[str, str], endpoint_text: str, environ: Mapping[str, str] | None = None) -> EtcdSecurity:
    """The security ``--rdzv-conf`` and ``--rdzv-endpoint`` ask for; an SpmdError naming what does not fit together."""
    protocol = conf.get("protocol", "").strip().lower()
    if protocol not in ("", "http", "https"):
        raise SpmdError(f"--rdzv-conf protocol={protocol}: use http or https")
    https = protocol == "https" or "https://" in endpoint_text
    if protocol == "http" and "https://" in endpoint_text:
        raise SpmdError(f"--rdzv-conf protocol=http but --rdzv-endpoint {endpoint_text} names https: pick one")
    files = {name: conf.get(name) or None for name in ("cacert", "cert", "key")}
    if not https and any(files.values()):
        raise SpmdError("--rdzv-conf names TLS files (cacert/cert/key) but etcd is reached over http: "
                        "add protocol=https or write the endpoints as https://host:port")
    if bool(files["cert"]) != bool(files["key"]):
        raise SpmdError("--rdzv-conf: a client certificate needs both cert= and key=")
    user = conf.get("user") or None
    password = None
    if conf.get("password_file"):
        try:
            password = Path(conf["password_file"]).read_text().rstrip("\n")
        except OSError as error:
            raise SpmdError(f"--rdzv-conf password_file={conf['password_file']}: cannot read it ({error})") from error
    elif user:
        password = settings.current().etcd_password if environ is None else environ.get(PASSWORD_ENV)
    if user and password is None:
        raise SpmdError(f"--rdzv-conf user={user} needs a password: set ${PASSWORD_ENV} or pass password_file=PATH")
    if password is not None and not user:
        raise SpmdError("--rdzv-conf password_file= needs user=NAME too")
    return EtcdSecurity(https, files["cacert"], files["cert"], files["key"], user, password)
