"""`elastic run --resume RUN_DIR` on real processes: a run of 20 steps on 4 nodes (a checkpoint
every 5) is stopped at once after step 10 (Ctrl-C twice: the first asks for a stop that saves,
which a hung node holds up; the second stops every process at once, exit 130, nothing saved),
and resumed at another layout (3 nodes x TP 2):
the resumed steps and final state equal the uninterrupted run's. A corrupt newest checkpoint is
detected and the one before is used (and said); a checkpoint of another model shape, or a run
dir with none, is refused with one line and exit code 2."""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from elastic.engine.checkpoint.files import list_steps, read_marker, step_dir
from elastic.engine.checkpoint.load import latest_complete
from elastic.transfer.shards import ShardKey

from .runs import STEPS, TOLERANCE, Result, max_rel_diff, reference_run

pytestmark = [pytest.mark.slow]

FLAGS = ["--model", "tiny", "--global-batch", "8", "--microbatch", "2", "--steps", str(STEPS), "--device", "cpu",
         "--fault-tolerance", "1", "--checkpoint-every", "5", "--lease-ttl", "10"]  # TTL: shared 2-core machines
STOP_AFTER = 10
NEXT_CHECKPOINT = 15


def elastic_run(*args: str, timeout: float = 150) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "elastic.cli", "run", "--no-report", *args], capture_output=True, text=True,
                          timeout=timeout)


@dataclass(frozen=True)
class Interrupted:
    """The run stopped at once (Ctrl-C twice) after step 10, and the uninterrupted reference."""

    run_dir: Path
    stdout: str
    returncode: int
    reference: Result
    second_ctrl_c_s: float
    """Seconds from the second Ctrl-C to the launcher's exit."""


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory: pytest.TempPathFactory) -> Interrupted:
    reference = reference_run(tmp_path_factory, steps=STEPS)
    run_dir = tmp_path_factory.mktemp("resume") / "first"
    # Node 3 is stopped (SIGSTOP) as soon as its agent sees step 11 in flight, so the job freezes
    # between the checkpoints of steps 10 and 15 before the Ctrl-C lands, however far the
    # launcher's printing lags behind the workers on a loaded machine (the hang is found by lease
    # expiry only after 10 s: the Ctrl-C comes first). The agent learns of commits through the
    # progress key, written at most every 0.1 s, so the stop lands a few steps late: at ~65 ms a
    # step (tiny, 2 pipelines of 2 stages: devices of 12 MiB) steps 11-13 may still commit, and
    # the 4 steps before the next checkpoint leave room for that. Node 3 writes no checkpoint
    # shard (pipeline 0's workers do), so freezing it does not hold up the checkpoint of step 10.
    cmd = [sys.executable, "-m", "elastic.cli", "run", "--no-report", *FLAGS, "--nodes", "4", "--device-memory-gib", "0.023",
           "--run-dir", str(run_dir), "--inject", f"hang:node=3,step={STOP_AFTER + 1}"]
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        assert launcher.stdout is not None
        for line in launcher.stdout:
            lines.append(line)
            if line.startswith(f"step {STOP_AFTER}/{STEPS}"):
                # The checkpoint of step 10 is written in the background; on a loaded machine its
                # fsyncs may still run two steps later, and a Ctrl-C then would (rightly) fall back
                # to step 5. The job is frozen before step 15: let the write finish first.
                _wait_complete(run_dir / "checkpoints", 10, timeout=6.0)
                launcher.send_signal(signal.SIGINT)  # Ctrl-C: a stop that saves, held up by the hung node
                break
        for line in launcher.stdout:
            lines.append(line)
            if "finishing the step in flight" in line:
                break
        launcher.send_signal(signal.SIGINT)  # Ctrl-C again: everything stops at once
        second = time.monotonic()
        rest, _ = launcher.communicate(timeout=60)
        second_ctrl_c_s = time.monotonic() - second
    finally:
        with contextlib.suppress(ProcessLookupError):
            launcher.kill()
        launcher.wait(10)
    return Interrupted(run_dir=run_dir, stdout="".join(lines) + rest, returncode=launcher.returncode,
                       reference=reference, second_ctrl_c_s=second_ctrl_c_s)


def _wait_complete(directory: Path, step: int, *, timeout: float) -> None:
    """Wait (at most `timeout` s) until the checkpoint of `step` is complete."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if latest_complete(directory, num_layers=6, tp_degree=1) == step:
            return
        time.sleep(0.05)


def resume(source: Path, run_dir: Path, *flags: str) -> tuple[subprocess.CompletedProcess[str], dict, dict]:  # type: ignore[type-arg]
    state, summary = run_dir.parent / f"{run_dir.name}.pt", run_dir.parent / f"{run_dir.name}.json"
    out = elastic_run(*FLAGS, "--resume", str(source), "--run-dir", str(run_dir), "--final-state", str(state),
                      "--summary", str(summary), *flags)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out, json.loads(summary.read_text()), torch.load(state, weights_only=True)


def check_continues(summary: dict, state: dict[str, torch.Tensor], reference: Result, *, start: int) -> None:  # type: ignore[type-arg]
    """Steps start+1..20 and the final state of the resumed run are the uninterrupted run's."""
    ref_summary, ref_state = reference
    assert summary["first_step"] == start and summary["steps_committed"] == STEPS - start
    for i, (got, want) in enumerate(zip(summary["losses"], ref_summary.losses[start:], strict=True)):
        assert abs(got - want) <= TOLERANCE * abs(want), f"step {start + i + 1}: loss {got} vs uninterrupted {want}"
    diff = max_rel_diff(state, ref_state)
    assert diff <= TOLERANCE, f"final state differs from the uninterrupted run by {diff:.2e}"


@pytest.mark.timeout(400)
def test_a_run_stopped_after_step_10_resumes_on_3_nodes_at_tp_2_exactly(interrupted: Interrupted, tmp_path: Path) -> None:
    assert interrupted.returncode == 130, interrupted.stdout[-3000:]
    print(f"second Ctrl-C -> exit {interrupted.second_ctrl_c_s:.2f} s")
    assert interrupted.second_ctrl_c_s < 20, "the second Ctrl-C stops every process at once"
    assert "stopped at step" not in interrupted.stdout
    assert f"step {NEXT_CHECKPOINT}/{STEPS}" not in interrupted.stdout
    assert list_steps(interrupted.run_dir / "checkpoints") == [5, 10]
    out, summary, state = resume(interrupted.run_dir, tmp_path / "second", "--nodes", "3", "--gpus-per-node", "2")
    text = f"resumed from step 10 of {interrupted.run_dir}"
    assert text in out.stdout
    assert summary["resumed_from"]["step"] == 10 and summary["resumed_from"]["skipped"] == []
    assert summary["resumed_from"]["tp_degree"] == 1 and summary["resumed_from"]["text"].startswith(text)
    assert summary["world_size"] == 6
    assert "step 11/20" in out.stdout and "step 10/20" not in out.stdout
    check_continues(summary, state, interrupted.reference, start=10)


@pytest.mark.timeout(300)
def test_a_corrupt_newest_checkpoint_is_detected_and_the_one_before_is_used(
    interrupted: Interrupted, tmp_path: Path
) -> None:
    source = tmp_path / "corrupt"
    shutil.copytree(interrupted.run_dir, source, ignore=shutil.ignore_patterns("etcd"))
    checkpoints = source / "checkpoints"
    marker = read_marker(checkpoints, 10, ShardKey(3, 0))
    assert marker is not None
    victim = max((step_dir(checkpoints, 10) / marker.data).rglob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x5A
    victim.write_bytes(bytes(data))
    out, summary, state = resume(source, tmp_path / "second", "--nodes", "2")
    warning = [line for line in out.stderr.splitlines() if "checkpoint of step 10" in line]
    assert len(warning) == 1 and "corrupt" in warning[0] and "falling back to the one before" in warning[0]
    assert f"resumed from step 5 of {source}" in out.stdout
    skipped = summary["resumed_from"]["skipped"]
    assert summary["resumed_from"]["step"] == 5 and [s["step"] for s in skipped] == [10]
    assert "layer-0003-tp-00" in skipped[0]["why"] and "CRC-32" in skipped[0]["why"]
    check_continues(summary, state, interrupted.reference, start=5)


@pytest.mark.timeout(120)
def test_another_model_shape_or_no_checkpoint_is_refused_with_one_line(interrupted: Interrupted, tmp_path: Path) -> None:
    other = elastic_run(*FLAGS, "--resume", str(interrupted.run_dir), "--nodes", "2", "--model", "small",
                        "--run-dir", str(tmp_path / "other"), timeout=60)
    assert other.returncode == 2, other.stderr
    assert len(other.stderr.strip().splitlines()) == 1, other.stderr
    assert "another model" in other.stderr and f"--resume {interrupted.run_dir}" in other.stderr
    seed = elastic_run(*FLAGS, "--resume", str(interrupted.run_dir), "--nodes", "2", "--seed", "1",
                       "--run-dir", str(tmp_path / "seed"), timeout=60)
    assert seed.returncode == 2 and len(seed.stderr.strip().splitlines()) == 1, seed.stderr
    assert "data seed (--seed) 0, this run 1" in seed.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    none = elastic_run(*FLAGS, "--resume", str(empty), "--nodes", "2", "--run-dir", str(tmp_path / "x"), timeout=60)
    assert none.returncode == 2 and len(none.stderr.strip().splitlines()) == 1
    assert "has no checkpoint" in none.stderr
    assert not (tmp_path / "other" / "checkpoints").exists()  # refused before anything started
