"""A job against an etcd with client TLS (--client-cert-auth) and user/password auth, the job's
user allowed only its own prefix (tests/secure_etcd.py): the launcher, agents, workers and the
operator CLI all reach it with the ELASTIC_ETCD_* credentials of the environment; a recovery
fetches its shards over the gRPC shard path, which is mutual TLS with the same CA; the run ends
equal to the failure-free one; no log holds the token or a password; and bad credentials get one
clear line (exit 2) with nothing written to etcd or the run directory."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from elastic.records.injection import parse_injection
from elastic.records.node_workers import read_registrations
from elastic.records.summary import RunSummary
from elastic.transfer.client import FetchConfig, TransferError, fetch_shards
from elastic.transfer.shards import ShardKey
from elastic.transfer.tls import TlsConfig
from tests.secure_etcd import JOB_PASSWORD, ROOT_PASSWORD, Pki, SecureEtcd, clean_env, make_pki

from .runs import STEPS, LiveJob, check_same_training, reference_run, tiny_config

pytestmark = [pytest.mark.slow]

Reference = tuple[RunSummary, dict[str, torch.Tensor]]
JOB = "secured"
TOKEN = "tok-3f9a61c2d7e0b5a4"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    return reference_run(tmp_path_factory, steps=STEPS)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def secure(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureEtcd]:
    with SecureEtcd(pki, tmp_path_factory.mktemp("secure-etcd")) as etcd:
        etcd.enable_auth(job=JOB)
        yield etcd


def _cli(*argv: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "elastic.cli", *argv], capture_output=True, text=True, env=env,
                          timeout=timeout)


def _probe_shard_server(job: LiveJob) -> None:
    """A live worker's shard server speaks TLS only: a plain client gets nothing, a TLS client
    with the job's CA but the wrong token is refused by the token check, past the handshake."""
    address = next(iter(read_registrations(job.client, job.rk).values())).transfer_address
    key = ShardKey(0, 0)
    plain = FetchConfig(token=TOKEN, generation=job.generation(), max_attempts=1, stall_timeout_s=5.0)
    with pytest.raises(TransferError) as refused:
        fetch_shards([key], {address: [key]}, plain)
    assert "UNAUTHENTICATED" not in str(refused.value), refused.value
    wrong = dataclasses.replace(plain, token="not-the-token", tls=TlsConfig.from_env())
    with pytest.raises(TransferError, match="UNAUTHENTICATED|token"):
        fetch_shards([key], {address: [key]}, wrong)


@pytest.mark.timeout(300)
def test_run_with_a_failure_on_tls_and_auth_matches_the_failure_free_run(
    secure: SecureEtcd, reference: Reference, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = secure.job_env()
    for name, value in env.items():
        monkeypatch.setenv(name, value)  # the launcher reads them; agents and workers inherit them
    config = tiny_config(tmp_path / "run", nodes=4, pipelines=2, steps=STEPS, partial_replay=False,
                         shard_transport="grpc")
    config = dataclasses.replace(config, injections=(parse_injection("kill:node=2,step=8"),))
    run = LiveJob(config, etcd=secure.endpoint, job=JOB, token=TOKEN, timeout_s=240.0).start()
    try:
        run.wait_committed(2, timeout=150.0)
        status = _cli("status", "--json", "--etcd", secure.endpoint, "--job", JOB, env=clean_env(**env))
        assert status.returncode == 0, status.stderr
        snapshot = json.loads(status.stdout)
        assert snapshot["job"] == JOB and snapshot["committed_steps"] >= 2 and snapshot["total_steps"] == STEPS
        _probe_shard_server(run)
        summary, state = run.result()
    finally:
        run.close()
    check_same_training(summary, state, reference)
    (rec,) = summary.recoveries
    assert rec["bytes_moved"] > 0 and rec["bytes_moved_collective"] == 0, rec  # every shard came over TLS gRPC
    run_dir = tmp_path / "run"
    secrets = [TOKEN, JOB_PASSWORD, ROOT_PASSWORD]
    logs = sorted((run_dir / "logs").rglob("*"))
    assert any(p.name.startswith("agent") for p in logs) and any("worker" in p.name for p in logs), logs
    leaked = [(str(p), s) for p in [*run_dir.rglob("*"), secure.log_path] if p.is_file() and p.name != "job.json"
              for s in secrets if s.encode() in p.read_bytes()]
    assert not leaked, leaked  # job.json (mode 0600) is where the operator CLI reads the token, by design
    assert all(s not in status.stdout + status.stderr for s in secrets)


BAD = {
    "wrong password": ({"ELASTIC_ETCD_PASSWORD": "guessed"}, "refused user 'secured-user'"),
    "wrong CA": ({"ELASTIC_ETCD_CA": "OTHER_CA"}, "TLS handshake with etcd at .* failed: CERTIFICATE_VERIFY_FAILED"),
    "missing cert file": ({"ELASTIC_ETCD_CERT": "/nonexistent/node.crt"}, r"\$ELASTIC_ETCD_CERT=/nonexistent/node.crt: no such file"),
    "no client cert": ({"ELASTIC_ETCD_CERT": None, "ELASTIC_ETCD_KEY": None}, "TLS handshake .* failed"),
    "no user": ({"ELASTIC_ETCD_USER": None, "ELASTIC_ETCD_PASSWORD": None}, r"set \$ELASTIC_ETCD_USER"),
}


def _bad_env(secure: SecureEtcd, pki: Pki, case: str) -> tuple[dict[str, str], str]:
    changes, message = BAD[case]
    changes = {k: (str(pki.other_ca) if v == "OTHER_CA" else v) for k, v in changes.items()}
    return clean_env(**secure.job_env(**changes)), message


@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", ["wrong password", "wrong CA", "missing cert file"])
def test_elastic_run_with_bad_credentials_says_so_and_writes_nothing(
    secure: SecureEtcd, pki: Pki, tmp_path: Path, case: str
) -> None:
    import re

    env, message = _bad_env(secure, pki, case)
    before = secure.keys()
    run_dir = tmp_path / "never"
    out = _cli("run", "--model", "tiny", "--nodes", "2", "--global-batch", "8", "--microbatch", "2", "--steps", "2",
               "--device", "cpu", "--etcd", secure.endpoint, "--job", JOB, "--run-dir", str(run_dir), env=env)
    assert out.returncode == 2, (out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and re.search(message, lines[0]), out.stderr
    assert not run_dir.exists() or not any(run_dir.iterdir()), sorted(run_dir.rglob("*"))
    assert secure.keys() == before


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(BAD))
def test_operator_cli_with_bad_credentials_says_so_in_one_line(secure: SecureEtcd, pki: Pki, case: str) -> None:
    import re

    env, message = _bad_env(secure, pki, case)
    for command in ("status", "events"):
        out = _cli(command, "--json", "--etcd", secure.endpoint, "--job", JOB, env=env)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1 and re.search(message, lines[0]), (command, out.stderr)
        assert JOB_PASSWORD not in out.stderr and "guessed" not in out.stderr


@pytest.mark.timeout(60)
def test_a_user_without_the_prefix_of_the_job_is_told_so(secure: SecureEtcd) -> None:
    out = _cli("status", "--etcd", secure.endpoint, "--job", "someone-else", env=clean_env(**secure.job_env()))
    assert out.returncode == 2, out.stderr
    assert "user 'secured-user' may not read /elastic/someone-else/" in out.stderr
    assert os.path.exists(secure.pki.ca)


@pytest.mark.timeout(200)
def test_a_run_on_its_own_etcd_ignores_the_credentials_meant_for_an_external_one(secure: SecureEtcd,
                                                                                 tmp_path: Path) -> None:
    """Without --etcd the launcher starts a plain etcd: its agents and workers must not take the
    ELASTIC_ETCD_* settings of the environment (TLS to a plain etcd fails every call)."""
    env = clean_env(**secure.job_env())
    out = _cli("run", "--model", "tiny", "--nodes", "2", "--global-batch", "8", "--microbatch", "2", "--steps", "3",
               "--device", "cpu", "--fault-tolerance", "0", "--no-report", "--run-dir", str(tmp_path / "run"),
               "--summary", str(tmp_path / "summary.json"), env=env, timeout=180)
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-2000:])
    assert json.loads((tmp_path / "summary.json").read_text())["steps_committed"] == 3
