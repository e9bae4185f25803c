"""`elastic events`: a job's history (joins, failures, generations, injections, recoveries, fatal),
oldest first, with times relative to the first event; `--json` prints one JSON object per line
with absolute times (fields: elastic/ops/events.py). `--follow` keeps printing new events, woken
by etcd watches on the history's sources, until Ctrl-C (exit 0). Exit codes as `elastic status`.

With `--run-dir` (and no `--etcd`), a run that has ended is read from its run directory (as
`elastic status` does, elastic/ops/run_history.py): the same events, as they were read from its
etcd, then one `ended` event saying how the run ended; `--follow` then stops there.
"""

from __future__ import annotations

import argparse
import sys
import threading
from typing import Any

from elastic.cli.main import UsageError
from elastic.cli.status_cmd import add_target_arguments, ended_run
from elastic.coordinator.client import TRANSIENT_ERRORS
from elastic.coordinator.watch import PrefixWatch
from elastic.ops.events import History, HistoryEvent, first_time, render_line
from elastic.ops.job_target import CONNECT_TIMEOUT_S, OpsError, find_job, open_client, resolve_target
from elastic.ops.run_history import end_event

_FOLLOW_POLL_S = 2.0
"""Re-read at least this often while following, even if the watch stays silent."""


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "events",
        help="history of an elastic job: joins, failures, generations, recoveries",
        description="Print an elastic job's history from etcd, oldest first. Exit 1 if etcd cannot be "
        "reached or the job is unknown.",
    )
    add_target_arguments(parser)
    parser.add_argument("--json", action="store_true", help="one JSON object per line, absolute times")
    parser.add_argument("--follow", action="store_true", help="keep printing new events until Ctrl-C")
    parser.add_argument(
        "--kind", action="append", default=None, metavar="K",
        help="only events of kind K (repeatable, or comma-separated), e.g. failure,generation",
    )
    parser.set_defaults(func=_run)


def _kinds(values: list[str] | None) -> set[str] | None:
    if values is None:
        return None
    kinds = {k.strip() for v in values for k in v.split(",") if k.strip()}
    if not kinds:
        raise UsageError("--kind needs at least one kind")
    return kinds


def _print_all(events: list[HistoryEvent], kinds: set[str] | None, *, as_json: bool) -> None:
    """Print `events` (of `kinds`), times relative to the first of them."""
    origin = first_time(events)
    for e in events:
        if kinds is None or e.kind in kinds:
            print(e.to_json() if as_json else render_line(e, origin), flush=True)


def _run(args: argparse.Namespace) -> int:
    kinds = _kinds(args.kind)
    try:
        target = resolve_target(etcd=args.etcd, job=args.job, run_dir=args.run_dir)
        ended = ended_run(args, target)
        if ended is not None:  # printed once, even with --follow: nothing more will come
            _print_all([*ended.events, end_event(ended)], kinds, as_json=args.json)
            return 0
        client = open_client(target)  # EtcdAccessError (a ValueError) for credentials etcd refuses
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    except OpsError as exc:
        print(f"elastic events: error: {exc}", file=sys.stderr)
        return 1
    watches: list[PrefixWatch] = []
    try:
        keys = find_job(client, target)
        history = History(client, keys)
        wake = threading.Event()
        if args.follow:  # started before the first read, so nothing written in between is missed
            watches = [PrefixWatch(client, prefix, lambda _events: wake.set()) for prefix in history.sources]
        origin: list[float | None] = [None]

        def show(events: list[HistoryEvent]) -> None:
            if origin[0] is None:
                origin[0] = first_time(events)
            for e in events:
                if kinds is None or e.kind in kinds:
                    print(e.to_json() if args.json else render_line(e, origin[0]), flush=True)

        try:
            show(history.read_all())
            while args.follow:
                wake.wait(_FOLLOW_POLL_S)
                wake.clear()
                show(history.poll())
        except TRANSIENT_ERRORS:
            raise OpsError(f"cannot reach etcd at {target.etcd} within {CONNECT_TIMEOUT_S:.0f} s") from None
        return 0
    except OpsError as exc:
        print(f"elastic events: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        for watch in watches:
            watch.cancel()
        client.close()
