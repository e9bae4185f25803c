"""bench/nccl_smoke.py on the CPU: the gloo path of the script the first GPU runs first (issue
60), so that it cannot rot where no GPU is. Each mode's process runs, every check passes, and the
figures it reports are there: 20 generations made, used and retired, the aborts from a second
thread returned, the wait after the busy abort ended as abandonment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(180)
def test_nccl_smoke_runs_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "smoke.json"
    proc = subprocess.run([sys.executable, "-m", "bench.nccl_smoke", "--device", "cpu", "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=170,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["ok"] and set(result["modes"]) == {"blocking", "nonblocking"}
    assert {c["risk"] for c in result["checks"]} == {1, 2, 3, 4, 6, 7, 8, 9}
    for mode, got in result["modes"].items():
        assert got["mode_env"] == {"blocking": "0", "nonblocking": "1"}[mode]
        rows = got["generations"]["rows"]
        assert [r["generation"] for r in rows] == list(range(1, 21)) and all(r["ok"] for r in rows)
        assert all(r["create_s"] > 0 and r["retire_s"] >= 0 for r in rows)
        assert got["abort_busy"]["wait_after_abort"] == "StepAborted"
        assert got["abort_idle"]["abort_returned"] and got["abort_busy"]["shutdown_closed"]
        assert got["first"]["group_desc"].startswith("elastic smoke/first")
