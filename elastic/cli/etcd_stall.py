"""`elastic inject etcd-stall --run-dir DIR --seconds S [--etcd-member I]`: a control-plane stall.

SIGSTOPs the etcd that `elastic run` started for the job (its PIDs are in DIR/job.json,
"etcd_pids"; with `--etcd-members 3`, member I, default 0), waits S seconds and SIGCONTs it: a
real signal, as a slow WAL disk or an overloaded etcd host would stall it. Every lease of the
job may expire meanwhile; the job must lose no node (issue 56: the leader probes each node whose
lease expired and keeps the ones that answer). After the stall it records an `etcd-stall` event.
An etcd the job did not start (`--etcd`) is not this command's to stop. Exit codes: 0 carried
out, 1 no etcd PID for that run dir (or the process is gone), 2 bad flags.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from elastic.cli.main import UsageError


def etcd_pids(run_dir: str) -> list[int]:
    """The PIDs of the etcd members `elastic run` started for the run in `run_dir` (member order)."""
    try:
        record = json.loads((Path(run_dir) / "job.json").read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read {run_dir}/job.json: {exc}") from None
    pids = record.get("etcd_pids") or []
    return [int(p) for p in pids if isinstance(p, int)]


def run_stall(args: argparse.Namespace) -> int:
    """Carry out `elastic inject etcd-stall` (module doc)."""
    if args.run_dir is None:
        raise UsageError("etcd-stall needs --run-dir (the run's job.json names the etcd processes it started)")
    if args.seconds is None or args.seconds <= 0:
        raise UsageError("etcd-stall needs --seconds S > 0")
    if args.node is not None or args.at_step is not None:
        raise UsageError("etcd-stall hits the job's etcd, not a node: no --node, no --at-step")
    pids = etcd_pids(args.run_dir)
    member = args.etcd_member
    if not 0 <= member < max(1, len(pids)) or not pids:
        print(f"elastic inject: error: no etcd member {member} in {args.run_dir}/job.json (the job's etcd was not "
              f"started by `elastic run`, or has {len(pids)} members)", file=sys.stderr, flush=True)
        return 1
    pid = pids[member]
    start = time.time()
    try:
        os.kill(pid, signal.SIGSTOP)
    except ProcessLookupError:
        print(f"elastic inject: error: etcd member {member} (pid {pid}) is not running", file=sys.stderr, flush=True)
        return 1
    print(f"elastic inject: etcd member {member} (pid {pid}) stopped for {args.seconds:g} s", flush=True)
    try:
        time.sleep(args.seconds)
    finally:
        os.kill(pid, signal.SIGCONT)
    end = time.time()
    print(f"elastic inject: etcd member {member} (pid {pid}) continued after {end - start:.1f} s", flush=True)
    _record(args, member=member, pid=pid, start=start, end=end)
    return 0


RECORD_WITHIN_S = 30.0
"""How long the `etcd-stall` event is tried for: a continued etcd may first answer slowly (it
revokes the leases that expired meanwhile)."""


def _record(args: argparse.Namespace, *, member: int, pid: int, start: float, end: float) -> None:
    """The `etcd-stall` event (tried again while etcd does not answer yet, up to RECORD_WITHIN_S)."""
    from elastic.cli.inject_cmd import JobError, OperatorJob
    from elastic.coordinator.client import etcd_unreachable
    from elastic.coordinator.events import record_event
    from elastic.ops.job_target import EtcdOutOfReach

    deadline = time.monotonic() + RECORD_WITHIN_S
    while True:
        try:
            job = OperatorJob(args)
            try:
                record_event(job.client, job.keys, who="cli", kind="etcd-stall", member=member, pid=pid,
                             started=start, ended=end, seconds=round(end - start, 3))
                return
            finally:
                job.close()
        except Exception as exc:  # noqa: BLE001 - the stall happened; only its record is missing
            out = isinstance(exc.__cause__, EtcdOutOfReach) or (
                not isinstance(exc, (JobError, UsageError)) and etcd_unreachable(exc))
            if out and time.monotonic() < deadline:
                time.sleep(0.2)
                continue
            print(f"elastic inject: the stall is not recorded: {exc}", file=sys.stderr, flush=True)
            return
