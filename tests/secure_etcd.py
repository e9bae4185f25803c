"""A secured etcd for tests: a CA and certificates made here (the `openssl` CLI), etcd serving
client TLS with --client-cert-auth, and user/password authentication with a job user whose role
covers only its job's prefix.

    pki = make_pki(tmp / "pki")
    with SecureEtcd(pki, tmp / "etcd") as etcd:
        etcd.enable_auth(job="j1")             # root + user "j1-user" with readwrite on /elastic/j1/
        env = etcd.job_env()                   # ELASTIC_ETCD_* of that user, for a run's processes

The certificates are elliptic-curve (P-256: quick to make) with SAN IP:127.0.0.1 and both the
serverAuth and clientAuth usages, so the same node certificate serves as etcd client and as
shard-transfer server and client (elastic/transfer/tls.py falls back to the etcd credentials).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from elastic.coordinator.etcd_server import find_etcd_binary, free_port

ROOT_PASSWORD = "root-secret-7c1"
"""Password of etcd's root user in these tests."""
JOB_PASSWORD = "job-secret-5e9"
"""Password of the job user."""

_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
_LEAF_EXT = (
    "basicConstraints=CA:FALSE\n"
    "keyUsage=digitalSignature,keyEncipherment\n"
    "extendedKeyUsage=serverAuth,clientAuth\n"
    "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
)


@dataclass(frozen=True)
class Pki:
    """The files of a test PKI: the job's CA, etcd's server certificate, a node certificate, and
    a second CA (with its own node certificate) that the job does not trust."""

    ca: Path
    server_cert: Path
    server_key: Path
    node_cert: Path
    node_key: Path
    other_ca: Path
    other_cert: Path
    other_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", *_EC, "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2",
             "-subj", f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)


def _leaf(d: Path, name: str, ca: str) -> None:
    _openssl("req", "-new", *_EC, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-out", f"{name}.crt", "-days", "2", "-extfile", "leaf.ext", cwd=d)


def make_pki(directory: Path) -> Pki:
    """Make the CAs and certificates under `directory` (the openssl CLI; no network)."""
    if shutil.which("openssl") is None:
        raise RuntimeError("these tests make their certificates with the openssl CLI, which is not installed")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "leaf.ext").write_text(_LEAF_EXT)
    _ca(d, "ca")
    _ca(d, "other-ca")
    _leaf(d, "etcd-server", "ca")
    _leaf(d, "elastic-node", "ca")  # CN is no etcd user: access is by user/password, not by certificate
    _leaf(d, "intruder", "other-ca")
    return Pki(ca=d / "ca.crt", server_cert=d / "etcd-server.crt", server_key=d / "etcd-server.key",
               node_cert=d / "elastic-node.crt", node_key=d / "elastic-node.key", other_ca=d / "other-ca.crt",
               other_cert=d / "intruder.crt", other_key=d / "intruder.key")


class SecureEtcd:
    """One etcd member on 127.0.0.1 with client TLS (--client-cert-auth) and, after
    `enable_auth`, user/password authentication; stopped by PID."""

    def __init__(self, pki: Pki, data_dir: Path, *, extra_args: tuple[str, ...] = ()) -> None:
        """`extra_args`: more etcd flags (e.g. `--auth-token-ttl 1`)."""
        self.pki, self.data_dir, self.extra_args = pki, Path(data_dir), extra_args
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.binary = find_etcd_binary()
        self.etcdctl = str(Path(self.binary).parent / "etcdctl")
        self.client_port, self.peer_port = free_port(), free_port()
        self.log_path = self.data_dir / "etcd.log"
        self.job: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self) -> SecureEtcd:
        peer = f"http://127.0.0.1:{self.peer_port}"
        client = f"https://{self.endpoint}"
        args = [self.binary, "--name", "secure", "--data-dir", str(self.data_dir / "data"),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"secure={peer}",
                "--client-cert-auth", "--trusted-ca-file", str(self.pki.ca),
                "--cert-file", str(self.pki.server_cert), "--key-file", str(self.pki.server_key),
                "--auto-compaction-mode", "periodic", "--auto-compaction-retention", "10s", *self.extra_args]
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it
        self._proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + 30.0
        while self.ctl("endpoint", "health", check=False, user=None).returncode != 0:
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"secure etcd did not become healthy; see {self.log_path}")
            time.sleep(0.2)
        return self

    def ctl(self, *args: str, check: bool = True, user: str | None = "root") -> subprocess.CompletedProcess[str]:
        """Run etcdctl against this member with the node certificate (as `user`, with its password)."""
        cmd = [self.etcdctl, f"--endpoints=https://{self.endpoint}", f"--cacert={self.pki.ca}",
               f"--cert={self.pki.node_cert}", f"--key={self.pki.node_key}", "--command-timeout=5s"]
        if user is not None:
            cmd.append(f"--user={user}:{ROOT_PASSWORD if user == 'root' else JOB_PASSWORD}")
        return subprocess.run([*cmd, *args], check=check, capture_output=True, text=True, timeout=30)

    def enable_auth(self, *, job: str) -> None:
        """Users root and `<job>-user` (a role with readwrite on `/elastic/<job>/` only), then auth on."""
        self.job = job
        steps = [("user", "add", f"root:{ROOT_PASSWORD}", "--interactive=false"),
                 ("user", "grant-role", "root", "root"),
                 ("role", "add", "job"),
                 ("role", "grant-permission", "job", "--prefix=true", "readwrite", f"/elastic/{job}/"),
                 ("user", "add", f"{job}-user:{JOB_PASSWORD}", "--interactive=false"),
                 ("user", "grant-role", f"{job}-user", "job"),
                 ("auth", "enable")]
        for step in steps:
            self.ctl(*step, user=None)

    def job_env(self, **changes: str | None) -> dict[str, str]:
        """The ELASTIC_ETCD_* environment of the job user (a None in `changes` drops a variable)."""
        assert self.job is not None, "enable_auth first"
        env: dict[str, str | None] = {
            "ELASTIC_ETCD_USER": f"{self.job}-user", "ELASTIC_ETCD_PASSWORD": JOB_PASSWORD,
            "ELASTIC_ETCD_CA": str(self.pki.ca), "ELASTIC_ETCD_CERT": str(self.pki.node_cert),
            "ELASTIC_ETCD_KEY": str(self.pki.node_key), **changes,
        }
        return {k: v for k, v in env.items() if v is not None}

    def keys(self, prefix: str = "/elastic/") -> list[str]:
        """Every key under `prefix`, read as root."""
        out = self.ctl("get", "--prefix", "--keys-only", prefix).stdout
        return [line for line in out.splitlines() if line.strip()]

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def __enter__(self) -> SecureEtcd:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def clean_env(**extra: str) -> dict[str, str]:
    """os.environ without any ELASTIC_ETCD_* / ELASTIC_TLS_* variable, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTIC_ETCD_", "ELASTIC_TLS_"))}
    with contextlib.suppress(KeyError):
        env["ELASTIC_ETCD_BINARY"] = os.environ["ELASTIC_ETCD_BINARY"]
    return {**env, **extra}
