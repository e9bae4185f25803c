"""`elastic run` as a subprocess for the fault tests that compare whole runs bit for bit
(tests/faults/test_interleaved_run.py, test_recompute_run.py): the run, its summary's checks
(steps committed, no worker restarted, the nodes lost), and the comparison of two runs."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

CliResult = tuple[dict[str, Any], dict[str, torch.Tensor], str]
"""(the run's summary, its final state, its stdout)."""


def run_cli(cmd: Sequence[str], run_dir: Path, *, committed: int, lost: list[list[int]], timeout: float) -> CliResult:
    """Run `cmd` (an `elastic run` command line) into `run_dir` with its final state and summary
    written there; it must exit 0 having committed `committed` steps, restarted no worker and
    lost `lost` (the nodes of each recovery)."""
    final = run_dir / "final_state.pt"
    full = [*cmd, "--run-dir", str(run_dir), "--final-state", str(final), "--summary", str(run_dir / "summary.json")]
    proc = subprocess.run(full, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd[4:]}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps_committed"] == committed and summary["worker_restarts"] == 0
    recoveries = summary["recoveries"]
    assert isinstance(recoveries, list)
    assert [r["lost_nodes"] for r in recoveries] == lost, recoveries
    return summary, torch.load(final), proc.stdout


def same_bits(got: CliResult, want: CliResult, what: str) -> None:
    """The same losses and bit-identical final parameters."""
    assert got[0]["losses"] == want[0]["losses"], what
    assert got[1].keys() == want[1].keys()
    differ = [name for name in got[1] if not torch.equal(got[1][name], want[1][name])]
    assert not differ, f"{what}: final parameters differ in {differ}"
