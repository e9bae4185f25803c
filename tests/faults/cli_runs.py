"""`elastic run` as a subprocess for the fault tests that compare whole runs bit for bit
(tests/faults/test_interleaved_run.py, test_recompute_run.py): the run, its summary's checks
(steps committed, no worker restarted, the nodes lost), and the comparison of two runs."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil
import torch

from elastic.ops.run_state import read_spec
from elastic.records.summary import load_final_state

CliResult = tuple[dict[str, Any], dict[str, torch.Tensor], str]
"""(the run's summary, its final state, its stdout)."""


def run_cli(cmd: Sequence[str], run_dir: Path, *, committed: int, lost: list[list[int]], timeout: float,
            split_ok: bool = False) -> CliResult:
    """Run `cmd` (an `elastic run` command line) into `run_dir` with its final state and summary
    written there; it must exit 0 having committed `committed` steps, restarted no worker and
    lost `lost` (the nodes of each recovery). Stragglers are reported, not acted on (unless `cmd`
    names a policy): a rebalance for a node slowed by a loaded test machine would add a generation
    (tests/faults/runs.py's jobs do the same; the policies have tests of their own).

    The final state is merged here from the run directory, as `--final-state` merges it (the
    same `load_final_state`), and no report is drawn: the launcher's `import torch` and
    matplotlib would add about 3.5 s to every run (tests/engine/test_cli_run.py and
    tests/ops/test_report.py cover those two). `split_ok`: nodes killed at one step may be seen
    in one leader round or in several (their agents inject a few ms apart): the recoveries must
    lose those nodes, each once, in any grouping."""
    policy = [] if "--straggler-policy" in cmd else ["--straggler-policy", "report"]
    full = [*cmd, *policy, "--no-report", "--run-dir", str(run_dir), "--summary", str(run_dir / "summary.json")]
    proc = run_to_end(full, run_dir, timeout)
    assert proc.returncode == 0, f"{cmd[4:]}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps_committed"] == committed and summary["worker_restarts"] == 0
    recoveries = summary["recoveries"]
    assert isinstance(recoveries, list)
    if split_ok:
        seen = [n for r in recoveries for n in r["lost_nodes"]]
        assert sorted(seen) == sorted(n for nodes in lost for n in nodes) and all(r["lost_nodes"] for r in recoveries), \
            recoveries
    else:
        assert [r["lost_nodes"] for r in recoveries] == lost, recoveries
    return summary, load_final_state(read_spec(run_dir)), proc.stdout


def run_to_end(full: Sequence[str], run_dir: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """`full` to its end within `timeout` s; past it, the launcher and every process under it
    (etcd, agents, workers) are SIGKILLed by PID and the failure shows where the run stood: its
    output and the end of each log in `run_dir`."""
    with subprocess.Popen(full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            tree: list[psutil.Process] = []
            with contextlib.suppress(psutil.NoSuchProcess):
                launcher = psutil.Process(proc.pid)
                tree = [launcher, *launcher.children(recursive=True)]
            for member in tree:  # psutil's handles: a pid reused meanwhile is not signalled
                with contextlib.suppress(psutil.NoSuchProcess):
                    member.kill()
            out, err = proc.communicate()
            logs = "".join(f"\n--- {log.relative_to(run_dir)} (end)\n{log.read_text(errors='replace')[-1500:]}"
                           for log in sorted(run_dir.rglob("*.log")))
            raise AssertionError(f"{full[4:]}: still running after {timeout} s (killed with {len(tree)} "
                                 f"processes)\n{out[-2000:]}\n{err[-2000:]}{logs[-12000:]}") from None
    return subprocess.CompletedProcess(full, proc.returncode, out, err)


def same_bits(got: CliResult, want: CliResult, what: str) -> None:
    """The same losses and bit-identical final parameters."""
    assert got[0]["losses"] == want[0]["losses"], what
    assert got[1].keys() == want[1].keys()
    differ = [name for name in got[1] if not torch.equal(got[1][name], want[1][name])]
    assert not differ, f"{what}: final parameters differ in {differ}"


def cli_in_process(*argv: str) -> tuple[int, str, str]:
    """`elastic ARGV...` in this process (`elastic.cli.main.main`): its exit code, stdout and stderr."""
    from elastic.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()
