"""torchrun's elastic-etcd rendezvous against an etcd with client TLS and user/password auth
(tests/secure_etcd.py): node a takes every credential from the environment, node b its CA and
client certificate from rdzv-conf; both join one round, and both workers inherit the credentials
in the environment (the agent a worker starts reaches etcd the same way)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.polling import wait_for
from tests.secure_etcd import JOB_PASSWORD, ROOT_PASSWORD, SecureEtcd, clean_env, make_pki

from .support import REPO

JOB = "rdzv-secured"
WORKER = str(Path(__file__).parent / "rdzv_worker.py")
TORCHRUN = str(Path(sys.executable).parent / "torchrun")


@pytest.fixture
def secure(tmp_path: Path) -> Iterator[SecureEtcd]:
    with SecureEtcd(make_pki(tmp_path / "pki"), tmp_path / "etcd") as etcd:
        etcd.enable_auth(job=JOB)
        yield etcd


def _torchrun(etcd: SecureEtcd, node: str, out: Path, env: dict[str, str], conf: str = "") -> subprocess.Popen[bytes]:
    args = [TORCHRUN, "--nnodes=1:2", "--nproc-per-node=1", "--rdzv-backend=elastic-etcd",
            f"--rdzv-endpoint={etcd.endpoint}", f"--rdzv-id={JOB}",
            f"--rdzv-conf=node_id={node},ttl=2,last_call_timeout=5{conf}",
            "--max-restarts=0", "--monitor-interval=0.5", WORKER, str(out), "90"]
    log = open(out / f"{node}.log", "wb")  # noqa: SIM115 (the child owns it)
    return subprocess.Popen(args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)


def _record(out: Path, node: str) -> dict[str, Any] | None:
    path = out / f"{node}-0.json"
    return json.loads(path.read_text()) if path.exists() else None


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_two_torchrun_nodes_join_one_round_on_a_secured_etcd(secure: SecureEtcd, tmp_path: Path) -> None:
    pki = secure.pki
    a = _torchrun(secure, "a", tmp_path, clean_env(**secure.job_env()))
    b_env = clean_env(**secure.job_env(ELASTIC_ETCD_CA=None, ELASTIC_ETCD_CERT=None, ELASTIC_ETCD_KEY=None))
    b = _torchrun(secure, "b", tmp_path, b_env, f",ca_cert={pki.ca},cert_cert={pki.node_cert},cert_key={pki.node_key}")
    try:
        ra, rb = wait_for(lambda: (_record(tmp_path, "a"), _record(tmp_path, "b"))
                          if _record(tmp_path, "a") and _record(tmp_path, "b") else None, 90.0, "workers of both nodes")
        assert ra["ELASTIC_JOB"] == rb["ELASTIC_JOB"] == JOB
        assert ra["ELASTIC_RDZV_ROUND"] == rb["ELASTIC_RDZV_ROUND"] == "1"
        assert {ra["RANK"], rb["RANK"]} == {"0", "1"} and ra["WORLD_SIZE"] == rb["WORLD_SIZE"] == "2"
        members = {k.rsplit("/", 1)[1] for k in secure.keys(f"/elastic/{JOB}/members/")}
        assert members == {"a", "b"}, members
        for rec in (ra, rb):  # b's rdzv-conf credentials reach its worker through the environment too
            assert (rec["ELASTIC_ETCD_USER"], rec["ELASTIC_ETCD_CA"], rec["ELASTIC_ETCD_CERT"], rec["ELASTIC_ETCD_KEY"]) \
                == (f"{JOB}-user", str(pki.ca), str(pki.node_cert), str(pki.node_key)), rec
    finally:
        for node, proc in (("a", a), ("b", b)):
            rec = _record(tmp_path, node)
            if rec is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(rec["pid"], signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    for node in ("a", "b"):
        log = (tmp_path / f"{node}.log").read_bytes()
        assert JOB_PASSWORD.encode() not in log and ROOT_PASSWORD.encode() not in log
