"""The operator commands fail fast, with one line and exit code 1, when etcd is not there; bad
flags are refused with one line and exit code 2 (in-process: the live tests run the console script)."""

from __future__ import annotations

import socket
import time

import pytest

from elastic.cli.main import main

pytestmark = pytest.mark.timeout(60)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.mark.parametrize("command", ["status", "events"])
def test_unreachable_etcd(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    endpoint = f"127.0.0.1:{_free_port()}"
    start = time.monotonic()
    code = main([command, "--etcd", endpoint, "--job", "j"])
    elapsed = time.monotonic() - start
    out, err = capsys.readouterr()
    assert code == 1 and out == ""
    assert err.strip() == f"elastic {command}: error: cannot reach etcd at {endpoint} within 5 s"
    assert elapsed < 10, f"took {elapsed:.1f} s"  # the call deadline is 5 s; a refused port fails at once


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ([], "give --etcd HOST:PORT or --run-dir DIR"),
        (["--etcd", "nohost"], "etcd endpoint must look like host:port"),
        (["--etcd", "127.0.0.1:2379", "--job", "bad/id"], "job id 'bad/id' must be"),
        (["--etcd", "127.0.0.1:2379", "--window", "1"], "--window must be >= 2"),
        (["--etcd", "127.0.0.1:2379", "--watch", "0"], "--watch must be positive"),
    ],
)
def test_bad_flags_exit_2(flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["status", *flags])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_run_dir_without_job_file(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["events", "--run-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "job.json does not exist" in err, err
