"""`elastic run`'s signals, and how a run stopped on request ends (elastic/roles/job_stop.py).

While the job runs (generation 1 published, until it ends), the first Ctrl-C (SIGINT) or
SIGTERM asks for a stop that saves: the job finishes the step in flight, every worker writes a
checkpoint at that step boundary and waits until it is on disk, and the launcher exits 130
(SIGINT) or 143 (SIGTERM), its last line naming the step and the `--resume` command. The job's
processes run in sessions of their own, so a terminal's Ctrl-C reaches the launcher alone. A
second Ctrl-C stops every process at once (by PID, no checkpoint), exit 130; a repeated SIGTERM
changes nothing (`timeout` and schedulers send one each; they follow with SIGKILL). A stop that
`elastic drain --all` asked for ends the run the same way, with exit code 3. Before the job runs
or after it ended, or with `--checkpoint-every 0` (nothing to save), both signals stop at once
(while `launch_elastic` runs, the launcher raises that stop itself within 0.25 s, where no gRPC
lock is held: elastic/roles/interrupt.py).
A stop not done within $ELASTIC_STOP_GRACE_S seconds (default 60) stops every process at once.
SIGHUP (the terminal closed) stops every process at once: the job's processes, in sessions of
their own, no longer get it from the terminal themselves.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import sys
from pathlib import Path
from typing import Any

from elastic.cli.main import UsageError
from elastic.roles.interrupt import Interrupt
from elastic.roles.job_stop import STOP_GRACE_ENV, STOP_GRACE_S, JobStop, JobStopped, StopTimedOut

EXIT_STOPPED = 3
"""`elastic run`'s exit code after a stop that `elastic drain --all` asked for."""
EXIT_CODES = {"sigint": 128 + signal.SIGINT, "sigterm": 128 + signal.SIGTERM, "cli": EXIT_STOPPED}
"""Exit code of a run stopped on request, by who asked."""
_STRIP = ("--resume", "--inject")
"""Flags of the stopped run that its `--resume` command leaves out (the resume names its own
source; injected faults were for the first run)."""


def stop_on_signals(config: Any, interrupt: Interrupt) -> JobStop | None:
    """Install the handlers of the module doc for an elastic run of `config` (ElasticConfig); the
    JobStop they ask (None with `--checkpoint-every 0`: the signals stop at once). A stop at once
    asked while `launch_elastic` runs is only recorded in `interrupt`: the launcher raises it
    where no lock is held (elastic/roles/interrupt.py)."""
    job_stop = None
    if config.checkpoint_every > 0:
        try:
            grace = float(os.environ.get(STOP_GRACE_ENV, STOP_GRACE_S))
        except ValueError:
            raise UsageError(f"${STOP_GRACE_ENV} must be seconds, got {os.environ[STOP_GRACE_ENV]!r}") from None
        job_stop = JobStop(grace_s=grace)

    def handler(signum: int, frame: object) -> None:
        if job_stop is not None and job_stop.armed and job_stop.ask("sigint" if signum == signal.SIGINT else "sigterm"):
            _say_now(
                f"elastic run: {'Ctrl-C (SIGINT)' if signum == signal.SIGINT else 'terminated (SIGTERM)'}: finishing "
                "the step in flight, then every worker saves a checkpoint at that step boundary and the job stops "
                "(Ctrl-C again stops at once, without saving)"
            )
            return
        if job_stop is not None and job_stop.armed and signum == signal.SIGTERM:
            return  # a repeated SIGTERM: the stop that saves goes on
        if signum == signal.SIGTERM:
            _say_now("elastic run: terminated (SIGTERM); stopping every process of the job")
        interrupt.stop_at_once(signum, ignore=_STOPPING)

    def hang_up(signum: int, frame: object) -> None:
        """SIGHUP: unwind at once (the launcher's cleanup stops the job's processes by PID), silently."""
        interrupt.stop_at_once(signum, ignore=_STOPPING)

    signal.signal(signal.SIGHUP, hang_up)
    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    return job_stop


_STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""Ignored once one of them stops the run at once: nothing may cut the cleanup short."""


def _say_now(line: str) -> None:
    """One line to stderr from a signal handler: an unbuffered write (the main thread may be
    inside a print), and no error if the terminal is gone."""
    with contextlib.suppress(OSError, ValueError):
        os.write(sys.stderr.fileno(), (line + "\n").encode())


def resume_command(argv: list[str], run_dir: Path) -> str:
    """`elastic run --resume RUN_DIR` with the stopped run's other flags (`argv` after `run`),
    less those of `_STRIP`, quoted for a shell."""
    kept: list[str] = []
    skip = False
    for token in argv:
        if skip:
            skip = False
            continue
        name = token.split("=", 1)[0]
        if len(name) >= 4 and any(flag.startswith(name) for flag in _STRIP):  # argparse takes abbreviations
            skip = "=" not in token
            continue
        kept.append(token)
    return shlex.join(["elastic", "run", "--resume", str(run_dir), *kept])


def report_stopped(args: argparse.Namespace, stopped: JobStopped, run_dir: Path) -> int:
    """Write the stopped run's summary (run dir and `--summary`), print its last line (the step
    and the `--resume` command), and return its exit code (EXIT_CODES)."""
    outcome = stopped.outcome
    summary_json = json.dumps(stopped.summary.to_dict(), indent=1)
    (run_dir / "summary.json").write_text(summary_json)
    if args.summary is not None:
        args.summary.write_text(summary_json)
    command = resume_command(_run_argv(args), run_dir)
    if outcome.complete:
        print(f"elastic run: stopped at step {outcome.step}, checkpoint complete; resume with: {command}", flush=True)
    else:
        print(f"elastic run: stopped at step {outcome.step}, but its checkpoint is incomplete in "
              f"{outcome.checkpoint_dir} (a worker could not write it); {command} starts from the newest "
              "complete one", flush=True)
    return EXIT_CODES[outcome.by]


def report_stop_timed_out(args: argparse.Namespace, exc: StopTimedOut, job_stop: JobStop | None,
                          run_dir: Path) -> int:
    """Print why the stop did not save and how to resume; 130/143 for a signal's stop, else 1."""
    print(f"elastic run: error: {exc}; resume with: {resume_command(_run_argv(args), run_dir)}", file=sys.stderr,
          flush=True)
    by = job_stop.by if job_stop is not None else None
    return EXIT_CODES[by] if by in ("sigint", "sigterm") else 1


def _run_argv(args: argparse.Namespace) -> list[str]:
    """The arguments after `run` of this invocation (`elastic.cli.main` keeps them)."""
    argv = list(getattr(args, "argv", None) or sys.argv[1:])
    return argv[1:] if argv[:1] == ["run"] else argv
