"""A whole-job stop that saves, on real processes (`elastic run` subprocesses, real signals).

- Ctrl-C while step 12 of 20 is in flight, checkpoints every 5, sent as a terminal sends it: SIGINT
  to the launcher's process group (the launcher's pid leads it; its agents, workers and etcd run
  in sessions of their own and must not die of it):
  the job finishes the step in flight, stops at the next step boundary S >= 12 with a complete
  checkpoint of step S (the step it committed last), and exits 130 naming S and the `--resume`
  command. Resumed at another layout (2 nodes instead of 4), the run recomputes no committed
  step (`resumed_from` and `first_step` are S) and ends with the uninterrupted run's state (1e-5).
- SIGTERM, twice (a scheduler and `timeout` each send one): the same stop, exit 143.
- `elastic drain --all` from another process: the same stop; the command returns once the
  checkpoint is complete and `elastic run` exits 3.

The signal is sent once the workers' own step log shows the step committed (not the launcher's
printed line, which may lag behind the workers on a loaded machine). Every process a launcher
started is found from its pid (psutil children) and killed by pid if a test fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from elastic.cli.run_stop import resume_command
from elastic.engine.checkpoint.load import latest_complete
from elastic.records.progress import read_step_logs
from tests.polling import wait_for

from .runs import TOLERANCE, max_rel_diff

STEPS = 20
SHAPE = ["--model", "tiny", "--global-batch", "16", "--microbatch", "2", "--device", "cpu"]
FLAGS = [*SHAPE, "--fault-tolerance", "1", "--checkpoint-every", "5", "--lease-ttl", "10"]  # TTL: shared 2-core machines
LAYERS = 6
"""Planning layers of tiny (embedding, 4 blocks, head)."""
_STOPPED = re.compile(r"^elastic run: stopped at step (\d+), checkpoint complete; resume with: (.*)$")


class Launcher:
    """`elastic run ARGS` in a child interpreter, its output and the pids of every process it started."""

    def __init__(self, *args: str) -> None:
        # a process group of its own, led by the launcher's pid: what a terminal's foreground job is
        self.proc = subprocess.Popen([sys.executable, "-m", "elastic.cli", "run", "--no-report", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.pids: set[int] = set()
        self.out = ""

    def wait_committed(self, run_dir: Path, steps: int, timeout: float) -> None:
        """Until the workers' step log shows `steps` steps committed (step `steps` + 1 in flight)."""
        wait_for(lambda: len(read_step_logs(run_dir)) >= steps or self.proc.poll() is not None, timeout,
                 f"{steps} steps committed")
        assert self.proc.poll() is None, self.proc.communicate()[0][-3000:]
        self.pids |= {p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)}
        # agents and workers forked from a warm parent are not the launcher's children: by their --job
        job = json.loads((run_dir / "job.json").read_text())["job"]
        self.pids |= {p.pid for p in psutil.process_iter(["cmdline"]) if job in (p.info["cmdline"] or [])}

    def signal(self, sig: signal.Signals, *, group: bool = False) -> float:
        """Send `sig` to the launcher's pid, or with `group` to its whole process group (Ctrl-C)."""
        if group:
            os.killpg(self.proc.pid, sig)
        else:
            os.kill(self.proc.pid, sig)
        return time.monotonic()

    def finish(self, timeout: float) -> int:
        self.out, _ = self.proc.communicate(timeout=timeout)
        return self.proc.returncode

    def check_all_gone(self) -> None:
        """Every process the launcher started has ended (PDEATHSIG'd ones a moment after it)."""
        with contextlib.suppress(AssertionError):
            wait_for(lambda: not self.left(), 10, "the run's processes to end")
        assert not self.left(), f"processes of the run outlived it: {self.left()}"

    def left(self) -> list[int]:
        """The processes it started that are still there (zombies of other parents aside)."""
        alive = []
        for pid in self.pids:
            with contextlib.suppress(psutil.NoSuchProcess):
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
        return alive

    def clean_up(self) -> None:
        """Kill the launcher and everything it started, by pid."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def stopped_at(out: str) -> tuple[int, str]:
    """(S, the resume command) of the stopped run's last line."""
    match = _STOPPED.match(out.strip().splitlines()[-1])
    assert match, out[-3000:]
    return int(match.group(1)), match.group(2)


def check_saved(run_dir: Path, out: str, *, at_least: int) -> int:
    """The run stopped at the step it committed last (>= `at_least`), whose checkpoint is the
    newest complete one; that step."""
    step, command = stopped_at(out)
    committed = max(read_step_logs(run_dir)) + 1
    assert step == committed >= at_least, (step, committed, out[-3000:])
    assert f"step {step}/" in out and f"step {step + 1}/" not in out
    assert latest_complete(run_dir / "checkpoints", num_layers=LAYERS, tp_degree=1) == step
    assert command.startswith(f"elastic run --resume {run_dir} ")
    assert json.loads((run_dir / "summary.json").read_text())["steps_committed"] == step
    return step


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_ctrl_c_saves_the_step_boundary_and_a_resume_elsewhere_recomputes_nothing(tmp_path: Path) -> None:
    first = tmp_path / "first"
    launcher = Launcher(*FLAGS, "--steps", str(STEPS), "--nodes", "4", "--device-memory-gib", "0.023",
                        "--run-dir", str(first))
    try:
        launcher.wait_committed(first, 11, timeout=150)  # step 12 in flight
        sent = launcher.signal(signal.SIGINT, group=True)  # Ctrl-C
        code = launcher.finish(timeout=90)
        print(f"SIGINT -> exit {time.monotonic() - sent:.2f} s")
        assert code == 130, launcher.out[-3000:]
        assert "Ctrl-C (SIGINT): finishing the step in flight" in launcher.out
        step = check_saved(first, launcher.out, at_least=12)
        assert step < STEPS
        launcher.check_all_gone()
    finally:
        launcher.clean_up()
    second, state, summary = tmp_path / "second", tmp_path / "second.pt", tmp_path / "second.json"
    resumed = subprocess.run([sys.executable, "-m", "elastic.cli", "run", "--no-report", *FLAGS, "--steps", str(STEPS), "--nodes", "2",
                              "--resume", str(first), "--run-dir", str(second), "--final-state", str(state),
                              "--summary", str(summary)], capture_output=True, text=True, timeout=150)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    result = json.loads(summary.read_text())
    assert result["resumed_from"]["step"] == step and result["first_step"] == step, result["resumed_from"]
    assert result["steps_committed"] == STEPS - step and result["world_size"] == 2
    assert f"step {step}/{STEPS}" not in resumed.stdout and f"step {step + 1}/{STEPS}" in resumed.stdout
    ref_state, ref_summary = tmp_path / "ref.pt", tmp_path / "ref.json"
    reference = subprocess.run([sys.executable, "-m", "elastic.cli", "run", "--no-report", "--static", *SHAPE, "--steps",
                                str(STEPS), "--run-dir", str(tmp_path / "ref"), "--final-state", str(ref_state),
                                "--summary", str(ref_summary)], capture_output=True, text=True, timeout=150)
    assert reference.returncode == 0, reference.stderr[-3000:]
    want = json.loads(ref_summary.read_text())["losses"][step:]
    for i, (got, ref) in enumerate(zip(result["losses"], want, strict=True)):
        assert abs(got - ref) <= TOLERANCE * abs(ref), f"step {step + i + 1}: loss {got} vs uninterrupted {ref}"
    diff = max_rel_diff(torch.load(state, weights_only=True), torch.load(ref_state, weights_only=True))
    assert diff <= TOLERANCE, f"final state differs from the uninterrupted run by {diff:.2e}"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigterm_twice_saves_the_step_boundary_and_exits_143(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    launcher = Launcher(*FLAGS, "--steps", "500", "--nodes", "2", "--run-dir", str(run_dir))
    try:
        launcher.wait_committed(run_dir, 3, timeout=150)
        sent = launcher.signal(signal.SIGTERM)
        time.sleep(0.2)
        launcher.signal(signal.SIGTERM)  # `timeout` and a scheduler both send one: the stop goes on
        code = launcher.finish(timeout=90)
        print(f"SIGTERM -> exit {time.monotonic() - sent:.2f} s")
        assert code == 143, launcher.out[-3000:]
        assert "terminated (SIGTERM): finishing the step in flight" in launcher.out
        check_saved(run_dir, launcher.out, at_least=4)
        launcher.check_all_gone()
    finally:
        launcher.clean_up()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_drain_all_stops_the_job_with_a_checkpoint_and_waits_for_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    launcher = Launcher(*FLAGS, "--steps", "500", "--nodes", "2", "--run-dir", str(run_dir))
    try:
        launcher.wait_committed(run_dir, 3, timeout=150)
        job = json.loads((run_dir / "job.json").read_text())["job"]
        started = time.monotonic()
        drain = subprocess.run([sys.executable, "-m", "elastic.cli", "drain", "--all", "--run-dir", str(run_dir)],
                               capture_output=True, text=True, timeout=90)
        print(f"elastic drain --all returned after {time.monotonic() - started:.2f} s")
        assert drain.returncode == 0, drain.stdout + drain.stderr
        code = launcher.finish(timeout=60)
        print(f"elastic drain --all -> exit {time.monotonic() - started:.2f} s")
        assert code == 3, launcher.out[-3000:]
        assert "stop asked by elastic drain --all" in launcher.out
        step = check_saved(run_dir, launcher.out, at_least=4)
        assert f"elastic drain: job {job} stopped at step {step}, checkpoint complete" in drain.stdout, drain.stdout
        launcher.check_all_gone()
    finally:
        launcher.clean_up()


def test_the_resume_command_keeps_the_run_flags_but_resume_and_inject() -> None:
    argv = ["--model", "tiny", "--resume", "runs/old", "--inject=kill:node=1,step=3", "--nodes", "4",
            "--inject", "hang:node=2,step=5", "--resu=x", "--run-dir", "runs/a b"]
    assert resume_command(argv, Path("runs/a b")) == (
        "elastic run --resume 'runs/a b' --model tiny --nodes 4 --run-dir 'runs/a b'"
    )
