"""bench/activation_memory.py and bench/recompute_cost.py on tiny shapes, so that they cannot rot:
the first holds every recompute mode's saved bytes (TP 1 and 2, sequence parallelism off and on,
fp32 and bf16, with and without dropout) equal to the memory model's and exits 0 only then; the second runs each mode once and reports a ratio per mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(REPO))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dropout", ["0", "0.1"])
def test_activation_memory_equals_the_model_on_tiny(tmp_path: Path, dropout: str) -> None:
    out = tmp_path / "am.json"
    proc = subprocess.run([sys.executable, "-m", "bench.activation_memory", "--model", "tiny", "--seq-len", "64",
                           "--dropout", dropout, "--json", str(out)], cwd=REPO, env=ENV, capture_output=True, text=True,
                          timeout=110)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 18 and all(r["equal"] for r in rows)
    assert {(r["tp"], r["sequence_parallel"]) for r in rows} == {(1, False), (2, False), (2, True)}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_recompute_cost_runs_every_mode_on_tiny(tmp_path: Path) -> None:
    out = tmp_path / "cost.json"
    proc = subprocess.run([sys.executable, "-m", "bench.recompute_cost", "--model", "tiny", "--steps", "3",
                           "--rounds", "1", "--json", str(out)], cwd=REPO, env=ENV, capture_output=True, text=True,
                          timeout=170)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["ratio_to_none"]) == {"none", "selective", "full"} and result["ratio_to_none"]["none"] == 1.0
    assert all(s[0] > 0 for s in result["samples_s"].values())
