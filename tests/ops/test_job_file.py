"""`<run_dir>/job.json`: written whole (never half-read by the CLI) with mode 0600, and read back by
the operator CLI's `--run-dir` resolution."""

from __future__ import annotations

import stat
from pathlib import Path

from elastic.ops.job_target import resolve_target
from elastic.roles.launcher import write_job_file


def test_job_file_is_private_whole_and_read_back(tmp_path: Path) -> None:
    (tmp_path / "job.json").write_text('{"etcd": "127.0.0.1:1", "job": "old"}')
    path = write_job_file(tmp_path, etcd="127.0.0.1:2379", job="j1", token="secret")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.json"]  # no temporary file left
    target = resolve_target(etcd=None, job=None, run_dir=str(tmp_path))
    assert (target.etcd, target.job) == ("127.0.0.1:2379", "j1")
