"""`elastic inject {kill,hang,slow,partition} --node N`: a fault for a running elastic job
(`elastic inject etcd-stall --run-dir DIR --seconds S`: the job's etcd stopped, etcd_stall.py).

The request goes into the job's etcd (`injections/<id>`, see elastic/records/injection_requests.py); the
agent of the node's current incarnation carries it out at once, or while `--at-step S` is in
flight, and records its status and an event. `elastic drain` (drain_cmd.py) shares the helpers
here. Exit codes: 0 written (and, within `--wait`, carried out); 1 the job cannot take it (etcd
unreachable, no such job, wrong job token, node not a live member, step already committed,
refused); 2 bad flags.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from elastic.cli.main import UsageError

KINDS = ("kill", "hang", "slow", "partition", "etcd-stall")
_DONE_STATES = ("done", "refused", "fenced")


def add_job_arguments(parser: argparse.ArgumentParser, *, wait: float) -> None:
    """--etcd/--job/--run-dir (which job), --token (may it be changed) and --wait."""
    parser.add_argument("--etcd", default=None, metavar="HOST:PORT[,HOST:PORT...]", help="the job's etcd (one endpoint or its members)")
    parser.add_argument(
        "--job", default=None, metavar="ID", help="job id (default: the only job on that etcd)"
    )
    parser.add_argument(
        "--run-dir",
        default=None,
        metavar="DIR",
        help="run dir of `elastic run`: etcd, job and token from DIR/job.json",
    )
    parser.add_argument(
        "--token", default=None,
        help="the job token (default: $ELASTIC_JOB_TOKEN, else the token in DIR/job.json)",
    )
    parser.add_argument(
        "--wait", type=float, default=wait, metavar="SECONDS",
        help=f"wait this long for the outcome (default {wait:g}; 0: write the request and return)",
    )


class JobError(RuntimeError):
    """The job cannot take the request (printed as one line, exit code 1)."""


class OperatorJob:
    """A running job opened for a change: etcd client, keys, raw config; the token checked."""

    def __init__(self, args: argparse.Namespace) -> None:
        from elastic.coordinator.access import JobAccessError, admit
        from elastic.coordinator.jsonrecord import unpack_text
        from elastic.coordinator.keys import RunKeys
        from elastic.ops.job_target import OpsError, find_job, open_client, resolve_target

        if args.wait < 0:
            raise UsageError(f"--wait must be >= 0, got {args.wait}")
        try:
            target = resolve_target(etcd=args.etcd, job=args.job, run_dir=args.run_dir)
            self.client = open_client(target)  # EtcdAccessError (a ValueError) for credentials etcd refuses
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        except OpsError as exc:
            raise JobError(str(exc)) from exc  # the cause says whether etcd was only out of reach
        try:
            self.keys = find_job(self.client, target)
        except OpsError as exc:
            self.client.close()
            raise JobError(str(exc)) from exc
        self.rk = RunKeys(self.keys)
        value, _ = self.client.get(self.rk.config)
        stored, _ = self.client.get(self.keys.token)
        if value is None or stored is None:
            self.close()
            raise JobError(f"job {self.keys.job} at {target.etcd} is not an elastic run (no config or token)")
        self.raw = json.loads(unpack_text(value))
        token = args.token or os.environ.get("ELASTIC_JOB_TOKEN") or _token_of_run_dir(args.run_dir)
        try:  # the token record exists, so admit only checks (it never installs ours)
            admit(self.client, self.keys, token)
        except JobAccessError as exc:
            self.close()
            raise JobError(f"{exc}; nothing was written") from None

    @property
    def steps(self) -> int:
        return int(self.raw["spec"]["steps"])

    @property
    def lease_ttl(self) -> int:
        return int(self.raw["lease_ttl"])

    def members(self) -> dict[int, int]:
        """Live plan node -> its incarnation."""
        from elastic.records.workers import live_nodes

        return live_nodes(self.client, self.keys)

    def committed_steps(self) -> int:
        from elastic.records.progress import committed_steps

        return committed_steps(self.client, self.rk)

    def wait_outcome(
        self, request_id: str, timeout: float, *, command: str = "inject", say_running: bool = True
    ) -> Any:
        """The request's final status (done, refused, fenced) within `timeout` s, else the last seen."""
        from elastic.records.injection_requests import InjectionStatus

        deadline = time.monotonic() + timeout
        last = None
        while True:
            value, _ = self.client.get(self.rk.job.key("injection-status", request_id))
            if value is not None:
                status = InjectionStatus.from_json(value)
                if status.state in _DONE_STATES:
                    return status
                if say_running and (last is None or last.state != status.state):
                    print(f"elastic {command}: {request_id} {describe(status)}", flush=True)
                last = status
            if time.monotonic() >= deadline:
                return last
            time.sleep(0.1)

    def report_outcome(
        self, request_id: str, wait: float, *, command: str, pending: str, say_running: bool = True
    ) -> int:
        """Wait up to `wait` s for the request's outcome and print it; the exit code: 1 refused,
        else 0 (also when `wait` is 0 or the request is still `pending` after it)."""
        if wait == 0:
            return 0
        status = self.wait_outcome(request_id, wait, command=command, say_running=say_running)
        if status is None:
            print(f"elastic {command}: {request_id} {pending} after {wait:g} s (still pending)", flush=True)
            return 0
        print(f"elastic {command}: {request_id} {describe(status)}", flush=True)
        return 1 if status.state == "refused" else 0

    def close(self) -> None:
        self.client.close()


def describe(status: Any) -> str:
    """One status in words: `done at 17:04:05.123 (step 9 in flight): workers SIGKILLed`."""
    at = time.strftime("%H:%M:%S", time.localtime(status.at)) + f".{int(status.at % 1 * 1000):03d}"
    where = f" (step {status.step} in flight)" if status.step is not None else ""
    gen = f", generation {status.generation}" if status.generation is not None else ""
    return f"{status.state} at {at}{where}{gen}" + (f": {status.detail}" if status.detail else "")


def _token_of_run_dir(run_dir: str | None) -> str | None:
    if run_dir is None:
        return None
    try:
        token = json.loads((Path(run_dir) / "job.json").read_text()).get("token")
    except (OSError, ValueError):
        return None
    return token if isinstance(token, str) else None


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "inject",
        help="inject a fault (kill, hang, slow, partition) into a node of a running elastic job",
        description="Ask the agent of a node of a running elastic job to inject a fault, through the job's "
        "etcd: kill (SIGKILL its workers), hang (SIGSTOP workers and agent: its lease expires), slow "
        "(SIGSTOP/SIGCONT duty cycle: steps take about FACTOR times longer, and no failure is declared), "
        "partition (keepalives and peer traffic stop for SECONDS; the healed node finds itself fenced and "
        "leaves), etcd-stall (SIGSTOP the job's own etcd, or member --etcd-member of it, for SECONDS, then "
        "SIGCONT; needs --run-dir). Needs the job token.",
    )
    parser.add_argument("kind", choices=KINDS, help="the fault")
    parser.add_argument("--node", type=int, default=None, help="plan node to hit (a live member; not for etcd-stall)")
    parser.add_argument("--etcd-member", type=int, default=0, metavar="I",
                        help="etcd-stall: which member of the job's etcd cluster to stop (default 0)")
    parser.add_argument(
        "--at-step",
        type=int,
        default=None,
        metavar="S",
        help="while step S (1-based, as printed) is in flight",
    )
    parser.add_argument(
        "--seconds", type=float, default=None,
        help="slow: how long (default 10); partition: how long (default 2 x lease TTL + 1; must exceed the TTL); "
        "etcd-stall: how long etcd stays stopped",
    )
    parser.add_argument(
        "--steps", type=int, default=None, metavar="N",
        help="slow, instead of --seconds: while N steps are in flight, from the one in flight when it begins",
    )
    parser.add_argument(
        "--factor", type=float, default=None, help="slow: steps take about F times longer (default 2)"
    )
    parser.add_argument(
        "--hold-cpu", action=argparse.BooleanOptionalAction, default=None,
        help="slow: while the workers are stopped, a process per worker spins in their place, so that "
        "simulated nodes sharing this host's cores do not speed up (default: on)",
    )
    add_job_arguments(parser, wait=30.0)
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from elastic.records.injection_requests import InjectionRequest, request_id, submit_request

    if args.kind == "etcd-stall":
        from elastic.cli.etcd_stall import run_stall

        return run_stall(args)
    if args.node is None:
        raise UsageError(f"{args.kind} needs --node N")
    if args.node < 0:
        raise UsageError(f"--node must be >= 0, got {args.node}")
    if args.at_step is not None and args.at_step < 1:
        raise UsageError(f"--at-step must be >= 1 (steps are numbered from 1), got {args.at_step}")
    if args.factor is not None and args.kind != "slow":
        raise UsageError("--factor applies to slow only")
    if args.hold_cpu is not None and args.kind != "slow":
        raise UsageError("--hold-cpu applies to slow only")
    if args.steps is not None and (args.kind != "slow" or args.seconds is not None or args.steps < 1):
        raise UsageError("--steps N (N >= 1) applies to slow only, instead of --seconds")
    if args.seconds is not None and args.kind not in ("slow", "partition"):
        raise UsageError("--seconds applies to slow and partition only")
    if args.seconds is not None and args.seconds <= 0:
        raise UsageError(f"--seconds must be positive, got {args.seconds}")
    if args.factor is not None and args.factor <= 1:
        raise UsageError(f"--factor must be > 1, got {args.factor}")
    try:
        job = OperatorJob(args)
    except JobError as exc:
        print(f"elastic inject: error: {exc}", file=sys.stderr, flush=True)
        return 1
    try:
        members = job.members()
        if args.node not in members:
            live = ", ".join(str(n) for n in sorted(members)) or "none"
            raise JobError(
                f"node {args.node} is not a live member of job {job.keys.job} (live nodes: {live})"
            )
        if args.at_step is not None:
            committed = job.committed_steps()
            if args.at_step > job.steps:
                raise JobError(f"step {args.at_step} is past the job's last step {job.steps}")
            if args.at_step <= committed:
                raise JobError(
                    f"step {args.at_step} is already committed (step {committed + 1} is in flight)"
                )
        seconds, factor = args.seconds, args.factor
        if args.kind == "slow":
            seconds, factor = (seconds or 10.0) if args.steps is None else None, factor or 2.0
        if args.kind == "partition":
            seconds = seconds or 2.0 * job.lease_ttl + 1.0
            if seconds <= job.lease_ttl:
                raise JobError(
                    f"a partition of {seconds:g} s would go unnoticed (lease TTL {job.lease_ttl} s): give --seconds "
                    f"above {job.lease_ttl}"
                )
        req = InjectionRequest(
            id=request_id(args.kind, args.node, args.at_step), kind=args.kind, node=args.node,
            incarnation=members[args.node], when="step" if args.at_step is not None else "now", step=args.at_step,
            seconds=seconds, steps=args.steps, factor=factor, requested_at=time.time(), by="cli",
            hold_cpu=args.hold_cpu is not False,
        )
        submit_request(job.client, job.keys.root, req)
        when = f"while step {args.at_step} is in flight" if args.at_step is not None else "at once"
        what = ""  # only slow and partition have a factor / duration to show
        if args.kind == "slow":
            what = f" (x{factor:g} for {seconds:g} s)" if args.steps is None else f" (x{factor:g} for {args.steps} steps)"
        elif args.kind == "partition":
            what = f" ({seconds:g} s)"
        print(
            f"elastic inject: {req.id}: {args.kind}{what} node {args.node} (incarnation {req.incarnation}) "
            f"of job {job.keys.job} {when}",
            flush=True,
        )
        return job.report_outcome(req.id, args.wait, command="inject", pending="not carried out yet")
    except JobError as exc:
        print(f"elastic inject: error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        job.close()
