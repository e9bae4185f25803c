"""`elastic stragglers`: show or change a running job's straggler settings, with no restart.

`--policy off|report|rebalance|auto`, `--threshold X`, `--steps K`: the change goes into the
job's etcd (`straggler-policy`, elastic/records/stragglers.py: only the settings given; the rest
stay the run's `--straggler-*`), with a "straggler-policy" event. World rank 0's reporter and the
leader read it about once a second. The command then waits (up to `--wait` seconds, default 10)
until the `stragglers` record is written under the new policy, which says the reporter took it
in. Without a change it prints the settings in force and the marked nodes.

Exit codes: 0 done (or not confirmed within `--wait`, which it says), 1 the job cannot take it
(not an elastic run, wrong token), 2 bad flags.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from elastic.cli.inject_cmd import JobError, OperatorJob, add_job_arguments
from elastic.cli.main import UsageError
from elastic.planning.stragglers import POLICIES, StragglerConfig


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "stragglers",
        help="show or change a running job's straggler policy and thresholds (no restart)",
        description="Show the straggler settings in force and the marked nodes; with --policy, --threshold or "
        "--steps, change them on the running job: world rank 0 and the leader take the change in within about a "
        "second. Changing needs the job token.",
    )
    parser.add_argument("--policy", choices=POLICIES, default=None,
                        help="off: no factors, no marks; report: mark stragglers; rebalance: also re-split the "
                        "batch away from them; auto: also weigh a hot spare in their stage and dropping them")
    parser.add_argument("--threshold", type=float, default=None, metavar="X",
                        help="speed factor against peers that counts as slow (> 1)")
    parser.add_argument("--steps", type=int, default=None, metavar="K",
                        help="consecutive slow steps that mark a straggler, fast ones that clear it (>= 1)")
    add_job_arguments(parser, wait=10.0)
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    try:
        job = OperatorJob(args)
    except JobError as exc:
        print(f"elastic stragglers: error: {exc}", file=sys.stderr, flush=True)
        return 1
    try:
        return _change(job, args)
    except JobError as exc:
        print(f"elastic stragglers: error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        job.close()


def _change(job: OperatorJob, args: argparse.Namespace) -> int:
    from elastic.coordinator.events import record_event
    from elastic.records.stragglers import PolicyOverride, policy_key, read_policy, read_stragglers

    base = _run_settings(job)
    try:
        current = read_policy(job.client, job.keys, base)
    except ValueError as exc:
        print(f"elastic stragglers: warning: the settings in etcd are unreadable ({exc}); starting from the run's",
              file=sys.stderr)
        current = base
    if args.policy is None and args.threshold is None and args.steps is None:
        print(f"elastic stragglers: job {job.keys.job}: {_words(current)}")
        speeds = read_stragglers(job.client, job.keys)
        marked = [] if speeds is None else sorted(speeds.marked.items())
        print("stragglers: " + (", ".join(f"node {n} ({m.factor:.2f}x since step {m.since_step + 1})"
                                          for n, m in marked) or "none"))
        return 0
    # The settings given, and the earlier changes of the others (those that differ from the run's).
    fields = {name: getattr(args, name) if getattr(args, name) is not None else
              (getattr(current, name) if getattr(current, name) != getattr(base, name) else None)
              for name in ("policy", "threshold", "steps")}
    change = PolicyOverride(**fields, at=time.time())
    try:
        new = change.apply(base)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    job.client.put(policy_key(job.keys), change.to_json())
    reason = f"{_words(current)} -> {_words(new)}"
    record_event(job.client, job.keys, who="cli", kind="straggler-policy", reason=reason, policy=new.policy,
                 threshold=new.threshold, steps=new.steps)
    print(f"elastic stragglers: job {job.keys.job}: {reason}", flush=True)
    return _wait_taken(job, new, args.wait)


def _run_settings(job: OperatorJob) -> StragglerConfig:
    """The run's own settings (`elastic run --straggler-*`), from the job's config in etcd."""
    from elastic.coordinator.jsonrecord import from_data

    raw = job.raw.get("stragglers")
    if raw is None:
        return StragglerConfig()
    try:
        return from_data(StragglerConfig, raw)
    except ValueError as exc:
        raise JobError(f"job {job.keys.job}'s straggler settings are unreadable: {exc}") from None


def _words(config: StragglerConfig) -> str:
    return f"policy {config.policy}, threshold {config.threshold:g}, steps {config.steps}"


def _wait_taken(job: OperatorJob, new: StragglerConfig, wait: float) -> int:
    """Wait until the `stragglers` record is written under `new` (module doc)."""
    from elastic.records.stragglers import read_stragglers

    deadline = time.monotonic() + wait
    while True:
        speeds = read_stragglers(job.client, job.keys)
        if speeds is not None and speeds.policy == new.policy and speeds.threshold == new.threshold \
                and speeds.at >= time.time() - 60:
            print(f"elastic stragglers: world rank 0 took it in after step {speeds.step + 1}", flush=True)
            return 0
        if time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    if wait > 0:
        print(f"elastic stragglers: not confirmed within {wait:g} s (no step committed since, or the job is "
              "between generations); it takes effect when world rank 0 reads it", flush=True)
    return 0
