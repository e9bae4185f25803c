"""`elastic status`: nodes, pipelines, generation, committed step, throughput and the last recovery
of a running (or finished) elastic job, read from its etcd (fields: elastic/ops/status.py).

Exit codes: 0 printed; 1 etcd unreachable within 5 s, or the job is not there (the message lists
the jobs it has); 2 bad flags. `--watch` redraws until Ctrl-C, which ends it with code 0.

With `--run-dir` (and no `--etcd`), a run that has ended is read from its run directory instead
(elastic/ops/run_history.py): the last status its launcher wrote at the end, or, where it was
killed before writing one, the status read back from a copy of its etcd's data; the first line
(`ended` in --json) says how it ended. `--watch` then prints it once.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from elastic.cli.main import UsageError
from elastic.coordinator.client import TRANSIENT_ERRORS
from elastic.ops.job_target import (
    CONNECT_TIMEOUT_S,
    JobTarget,
    OpsError,
    find_job,
    open_client,
    resolve_target,
)
from elastic.ops.run_history import EndedRun, find_ended_run
from elastic.ops.status_read import DEFAULT_WINDOW, read_status
from elastic.ops.status_table import render_table

_CLEAR = "\x1b[H\x1b[2J"


def add_target_arguments(parser: argparse.ArgumentParser) -> None:
    """--etcd, --job and --run-dir: how the operator commands find a job (elastic/ops/job_target.py)."""
    parser.add_argument("--etcd", default=None, metavar="HOST:PORT[,HOST:PORT...]", help="the job's etcd (one endpoint or its members)")
    parser.add_argument(
        "--job", default=None, metavar="ID", help="job id (default: the only job on that etcd)"
    )
    parser.add_argument(
        "--run-dir", default=None, metavar="DIR",
        help="run dir of `elastic run`: read etcd and job from DIR/job.json",
    )


def ended_run(args: argparse.Namespace, target: JobTarget) -> EndedRun | None:
    """The run of `--run-dir` if it has ended (module doc), else None: read its etcd. Never with
    `--etcd`: an etcd named on the command line is read as asked. OpsError if its history cannot
    be read."""
    if args.run_dir is None or args.etcd is not None or target.job is None:
        return None
    return find_ended_run(Path(args.run_dir), job=target.job, etcd=target.etcd,
                          etcd_answers=lambda: _answers(target))


def _answers(target: JobTarget) -> bool:
    """Whether the target's etcd answers (refusing our credentials counts: the live path says so)."""
    try:
        open_client(target).close()
    except OpsError:
        return False
    except ValueError:  # EtcdAccessError
        pass
    return True


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "status",
        help="nodes, pipelines, progress and the last recovery of an elastic job",
        description="Read an elastic job's state from etcd: nodes (alive, incarnation, lease, address, "
        "workers), pipelines of the current generation, committed step, recent throughput and the "
        "last recovery with its breakdown. Exit 1 if etcd cannot be reached or the job is unknown.",
    )
    add_target_arguments(parser)
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object (fields: elastic/ops/status.py)"
    )
    parser.add_argument(
        "--watch", nargs="?", type=float, const=2.0, default=None, metavar="SECONDS",
        help="redraw every SECONDS (default 2) until Ctrl-C",
    )
    parser.add_argument(
        "--window", type=int, default=DEFAULT_WINDOW, metavar="K", help="throughput over the last K steps"
    )
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if args.watch is not None and args.watch <= 0:
        raise UsageError(f"--watch must be positive, got {args.watch}")
    if args.window < 2:
        raise UsageError(f"--window must be >= 2, got {args.window}")
    try:
        target = resolve_target(etcd=args.etcd, job=args.job, run_dir=args.run_dir)
        ended = ended_run(args, target)
        if ended is not None:  # printed once, even with --watch: it will not change
            json_indent = None if args.watch is not None else 1
            print(ended.status.to_json(indent=json_indent) if args.json else render_table(ended.status), flush=True)
            return 0
        client = open_client(target)  # EtcdAccessError (a ValueError) for credentials etcd refuses
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    except OpsError as exc:
        print(f"elastic status: error: {exc}", file=sys.stderr)
        return 1
    interrupted = threading.Event()
    if args.watch is not None:
        # A handler of our own: Ctrl-C ends the watch even when SIGINT was inherited as ignored
        # (a background job of a script), where Python installs none. The first one sets a flag,
        # so nothing is raised inside a gRPC call, and the loop ends after the current read; a
        # second one raises KeyboardInterrupt as usual (e.g. if stdout is blocked).
        def on_sigint(signum: int, frame: object) -> None:
            if interrupted.is_set():
                raise KeyboardInterrupt
            interrupted.set()

        signal.signal(signal.SIGINT, on_sigint)
    try:
        keys = find_job(client, target)
        while not interrupted.is_set():
            try:
                status = read_status(client, keys, etcd=target.etcd, window=args.window)
            except TRANSIENT_ERRORS:
                raise OpsError(
                    f"cannot reach etcd at {target.etcd} within {CONNECT_TIMEOUT_S:.0f} s"
                ) from None
            if args.json:
                text = status.to_json(indent=None if args.watch is not None else 1)
            else:
                text = render_table(status)
                if args.watch is not None and sys.stdout.isatty():
                    text = _CLEAR + text
            print(text, flush=True)
            if args.watch is None or interrupted.wait(args.watch):
                return 0
            if not args.json and not sys.stdout.isatty():
                print(flush=True)
        return 0
    except OpsError as exc:
        print(f"elastic status: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        client.close()
