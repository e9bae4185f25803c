"""bench/gpu_session.sh, the one command a lent GPU's session runs, rehearsed on the CPU (`--cpu`:
tiny, gloo) so that it cannot rot where no GPU runs it: every stage ends with exit 0, what comes
back fits the device tool's limits (at most 8 files, no deeper than two folders), and the first
bench/gpu_check.sh stage's report (with its profile) says what a CPU run must
(tests/bench/test_gpu_check.py `check_cpu_report`). `soak` (about a minute): run it before a lent
device's session (`pytest -m soak tests/bench/test_gpu_session.py`); the suite's default checks
the report's pieces (tests/bench/test_gpu_check.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench.test_gpu_check import check_cpu_report

REPO = Path(__file__).resolve().parents[2]
CPU_STEPS = 8
"""Steps of each bench/gpu_check.sh stage under `--cpu` (bench/gpu_session.sh)."""


@pytest.mark.slow
@pytest.mark.soak
@pytest.mark.timeout(300)
def test_the_session_script_rehearses_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(REPO / "bench" / "gpu_session.sh"), "--cpu"], env=env, capture_output=True,
                          text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    env_txt = (out / "env.txt").read_text()
    for stage in ("nccl_smoke", "gpu_check_124m", "gpu_check_350m", "sharded_cpu"):
        assert f"stage {stage}: exit 0" in env_txt, env_txt
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert len(files) <= 8 and all(f.count("/") <= 2 for f in files), files
    assert {"env.txt", "session.log", "nccl_smoke.json", "gpu_check_124m.json", "gpu_check_350m.json"} <= set(files)
    check_cpu_report(json.loads((out / "gpu_check_124m.json").read_text()), CPU_STEPS)
    assert json.loads((out / "gpu_check_350m.json").read_text())["passed"] is True
    log = (out / "session.log").read_text()
    assert "engine --static" in log and "PASSED" in log
    assert "on / off" in log
