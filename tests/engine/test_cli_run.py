"""`elastic run` end to end: equivalence across node counts and TP degrees, bad arguments,
and a crashed worker stopping the job with a clear error."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from elastic.cli.main import build_parser
from elastic.cli.run_config import build_plan, check_flags, rejoin_fenced
from tests.engine.runs import max_rel_diff

pytestmark = [pytest.mark.slow]

RUN = [sys.executable, "-m", "elastic.cli", "run"]
"""`elastic run` in a child interpreter."""
COMMON = ["--model", "tiny", "--global-batch", "16", "--microbatch", "2", "--steps", "4", "--device", "cpu"]


def elastic(*args: str, timeout: float = 170) -> subprocess.CompletedProcess[str]:
    cmd = [*RUN, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def run_cli(tmp: Path, runs: dict[str, tuple[str, ...]]) -> dict[str, tuple[dict, dict[str, torch.Tensor]]]:  # type: ignore[type-arg]
    """`elastic run` once per entry of `runs` (name -> its flags), all at once (most of each run is
    process start-up); name -> (its summary, its final state)."""
    procs = {}
    for name, flags in runs.items():
        cmd = [*RUN, *COMMON, *flags, "--final-state", str(tmp / f"{name}.pt"), "--summary", str(tmp / f"{name}.json"),
               "--run-dir", str(tmp / name)]
        with (tmp / f"{name}.out").open("w") as out, (tmp / f"{name}.err").open("w") as err:
            procs[name] = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)
    results = {}
    try:
        for name, proc in procs.items():
            proc.wait(timeout=200)
            out, err = (tmp / f"{name}.out").read_text(), (tmp / f"{name}.err").read_text()
            assert proc.returncode == 0, f"{name}: {err}"
            assert "step 4/4" in out and "loss" in out
            results[name] = (json.loads((tmp / f"{name}.json").read_text()),
                             torch.load(tmp / f"{name}.pt", weights_only=True))
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


@pytest.mark.timeout(240)
def test_node_counts_and_tp_degrees_write_the_same_final_state(tmp_path: Path) -> None:
    runs = run_cli(tmp_path, {
        "one": ("--nodes", "1", "--no-report"),
        # Devices of 12 MiB cannot hold `tiny` alone: the planner must form 2 pipelines of 2 stages.
        "four": ("--nodes", "4", "--fault-tolerance", "1", "--device-memory-gib", "0.023", "--no-report"),
        "tp": ("--nodes", "2", "--gpus-per-node", "2", "--fault-tolerance", "1"),
    })
    # The run report is drawn by default (tests/ops/test_report.py checks what it draws), and not with --no-report.
    assert [(tmp_path / name / "report.png").is_file() for name in ("one", "four", "tp")] == [False, False, True]
    (one, one_state), (four, four_state), (tp, tp_state) = runs["one"], runs["four"], runs["tp"]
    for summary in (one, four, tp):
        assert summary["steps_committed"] == 4 and len(summary["losses"]) == 4 and summary["tokens_per_s"] > 0
    assert four["pipelines"] == 2 and four["world_size"] == 4 and tp["world_size"] == 4
    # The default (80 GiB) profile makes the planner choose pure data parallelism.
    assert tp["pipelines"] == 2
    assert four["losses"] == pytest.approx(one["losses"], rel=1e-6)
    assert tp["losses"] == pytest.approx(one["losses"], rel=1e-6)
    assert max_rel_diff(four_state, one_state) <= 1e-5
    assert max_rel_diff(tp_state, one_state) <= 1e-5


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--model", "nope"], "unknown model preset"),
        (["--global-batch", "7", "--microbatch", "2"], "--microbatch 2 does not divide --global-batch 7"),
        (["--nodes", "1", "--fault-tolerance", "1"], "needs at least 2 nodes"),
        (["--gpus-per-node", "3"], "not divisible by --gpus-per-node 3"),
        (["--plan", "/nonexistent/plan.json"], "cannot read --plan"),
        (["--rejoin-fenced", "-1"], "--rejoin-fenced starts local nodes again: it must be >= 0 (got -1)"),
        (["--rejoin-fenced", "1", "--static"], "cannot go with --static or --agents external"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(flags: list[str], message: str) -> None:
    out = elastic(*flags, timeout=50)
    assert out.returncode == 2
    assert message in out.stderr and len(out.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("flags", "rejoins"),
    [([], 1), (["--rejoin-fenced", "0"], 0), (["--rejoin-fenced", "3"], 3), (["--static"], 0),
     (["--agents", "external"], 0)],
)
def test_a_fenced_local_node_rejoins_once_by_default(flags: list[str], rejoins: int) -> None:
    """A node fenced while it lived is healthy capacity: the launcher that started it starts it again."""
    args = build_parser().parse_args(["run", *flags])
    if "--agents" not in flags:  # external agents need an etcd, a job and a token to pass the checks
        check_flags(args)  # the default goes with --static: it raises nothing
    assert rejoin_fenced(args) == rejoins


@pytest.mark.parametrize(("flags", "warned"), [
    (["--nodes", "5", "--fault-tolerance", "1", "--global-batch", "8", "--device-memory-gib", "0.034",
      "--shard-optimizer", "off"], False),
    (["--nodes", "7", "--fault-tolerance", "0", "--global-batch", "16", "--device-memory-gib", "0.022",
      "--shard-optimizer", "on"], True),
])
def test_a_plan_over_the_device_is_planned_again_or_said(flags: list[str], warned: bool,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """`elastic run`'s plan is `elastic plan`'s: made again with memory held back where an uneven
    batch split left a worker over the device (tiny, 5 nodes, 0.034 GiB), and said on stderr where
    no plan avoids it (7 nodes, 0.022 GiB, sharded, f = 0; tests/planning/test_memory_fit.py)."""
    args = build_parser().parse_args(["run", "--model", "tiny", "--microbatch", "1", "--device", "cpu", *flags])
    assert (build_plan(args).memory_margin_bytes == 0) == warned
    assert ("elastic run: warning: the plan's largest worker exceeds the device" in capsys.readouterr().err) == warned


@pytest.mark.timeout(120)
def test_a_killed_worker_stops_the_job_and_is_named(tmp_path: Path) -> None:
    cmd = [*RUN, *COMMON[:-4], "--steps", "1000", "--device", "cpu"]
    cmd += ["--nodes", "2", "--fault-tolerance", "1", "--run-dir", str(tmp_path), "--static"]
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    workers: list[psutil.Process] = []
    try:
        assert launcher.stdout is not None
        for line in launcher.stdout:  # wait until training runs
            if line.startswith("step 2/"):
                break
        # The job's workers, by command line: forked from a warm parent, they are not the launcher's children.
        workers = [w for w in psutil.process_iter(["cmdline"])
                   if "elastic.roles.static_worker" in (w.info["cmdline"] or []) and str(tmp_path / "job.json") in w.info["cmdline"]]
        assert len(workers) == 2
        victim = workers[1]
        os.kill(victim.pid, signal.SIGKILL)
        _, err = launcher.communicate(timeout=60)
        assert launcher.returncode == 1
        assert f"(pid {victim.pid}) exited with code -9" in err
        time.sleep(0.5)
        assert not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers)
    finally:
        for p in [*workers, launcher]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
        launcher.wait(10)
