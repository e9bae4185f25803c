"""Every start-up failure of `elastic run` is one line on stderr naming what failed and what to
check, with exit code 2, not a traceback: an etcd endpoint where nothing listens (within the
client's retry time), an etcd that does not serve TLS to a TLS client, a run dir another live
launcher holds, a metrics port in use, and a job's own etcd that does not start."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import pytest

from elastic.coordinator import EtcdConfig, EtcdServer
from tests.secure_etcd import clean_env, make_pki

from .test_run_lock import HOLD

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

RUN = ["run", "--model", "tiny", "--nodes", "2", "--global-batch", "8", "--microbatch", "2", "--steps", "2",
       "--device", "cpu", "--no-report"]
STARTUP_S = 15.0
"""What the interpreter, torch's import and the planner may take before the launcher's first
etcd call, on a loaded 2-core machine."""


def _run(run_dir: Path, *flags: str, env: Mapping[str, str] | None = None) -> tuple[str, float]:
    """`elastic run` that must fail to start: its one stderr line, and how long it took."""
    began = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "elastic.cli", *RUN, "--run-dir", str(run_dir), *flags],
                         capture_output=True, text=True, timeout=80, env=dict(env if env is not None else os.environ))
    elapsed = time.monotonic() - began
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, (out.returncode, out.stderr)
    assert lines[0].startswith("elastic run: error: "), lines
    print(f"{elapsed:.1f} s: {lines[0]}")
    return lines[0], elapsed


def _nothing_written(run_dir: Path) -> bool:
    return not run_dir.exists() or not any(run_dir.iterdir())


def test_an_etcd_endpoint_where_nothing_listens(tmp_path: Path) -> None:
    """Before: 45 lines of etcd3 traceback after 16 s, exit 1. Now: the launcher's first check
    retries for the client's retry time (EtcdConfig.retry_s, 5 s; each refused attempt fails at
    once, a silent host at most one call's timeout more), then says so in one line."""
    with socket.socket() as sock:  # a port that was free a moment ago, and now refuses connections
        sock.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{sock.getsockname()[1]}"
    run_dir = tmp_path / "run"
    line, elapsed = _run(run_dir, "--etcd", endpoint)
    retry_s = EtcdConfig(endpoint=endpoint).retry_s
    assert f"etcd at {endpoint} did not answer within {retry_s:g} s (Connection refused)" in line
    assert elapsed < retry_s + STARTUP_S
    assert _nothing_written(run_dir)


def test_a_run_dir_held_by_a_live_launcher(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        line, elapsed = _run(run_dir)
        assert f"run dir {run_dir} is in use by a live elastic run (pid {holder.pid})" in line
        assert elapsed < STARTUP_S
        assert sorted(p.name for p in run_dir.iterdir()) == ["launcher.lock"]  # nothing of the refused run
    finally:
        holder.kill()
        holder.wait()


def test_a_metrics_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        run_dir = tmp_path / "run"
        line, _ = _run(run_dir, env={**os.environ, "ELASTIC_METRICS_PORT": str(port)})
    assert f"cannot serve metrics on 127.0.0.1:{port} ($ELASTIC_METRICS_PORT): Address already in use" in line
    assert f"(pid {os.getpid()}, " in line and "unset $ELASTIC_METRICS_PORT" in line
    assert _nothing_written(run_dir)


def test_an_own_etcd_that_does_not_start(tmp_path: Path) -> None:
    line, _ = _run(tmp_path / "run", env={**os.environ, "ELASTIC_ETCD_BINARY": "/bin/false"})
    assert "the job's own etcd did not start: etcd exited with 1; see " in line


def test_a_tls_client_against_a_plain_etcd(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki")
    with EtcdServer() as plain:
        run_dir = tmp_path / "run"
        line, _ = _run(run_dir, "--etcd", plain.endpoint, env=clean_env(ELASTIC_ETCD_CA=str(pki.ca)))
    assert f"etcd at {plain.endpoint} closes every connection: does it serve TLS?" in line
    assert _nothing_written(run_dir)
