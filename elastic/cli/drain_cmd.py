"""`elastic drain --node N`: remove a node from a running elastic job at a step boundary;
`elastic drain --all`: stop the whole job at a step boundary, with a checkpoint there.

--node: the request goes into the job's etcd (`injections/<id>`, kind drain); the leader refuses
it if the other nodes cannot form the job's f+1 pipelines, else publishes a generation without
the node ("drained node N"). The node's workers serve their shards until the survivors have
them, then exit 0; no failure is reported.

--all: the job's stop request (elastic/records/stop.py, what `elastic run`'s first Ctrl-C
writes): the job finishes the step in flight, every worker writes its checkpoint shards of that
step and exits 0, and `elastic run` exits 3 naming the step and its `--resume` command. The
command waits (up to `--wait` seconds, default 60) until that checkpoint is complete, so that
when it returns the job can be resumed; `--wait 0` returns once the request is written.

Exit codes: 0 drained or stopped (or still pending after `--wait`), 1 refused or the job cannot
take it (see inject_cmd.py; --all: a job without checkpoints), 2 bad flags.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from elastic.cli.inject_cmd import JobError, OperatorJob, add_job_arguments
from elastic.cli.main import UsageError


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "drain",
        help="remove a node from a running elastic job at a step boundary (no failure), or stop the whole "
        "job there with a checkpoint (--all)",
        description="Ask the leader of a running elastic job to take a node out at the next step boundary: "
        "a new generation without it is published, its workers hand their shards over and exit 0. Refused "
        "if the other nodes cannot form the job's f+1 pipelines. With --all, stop the whole job instead: it "
        "finishes the step in flight, every worker writes a checkpoint at that step boundary, and `elastic "
        "run` exits 3; this command waits (--wait) until the checkpoint is complete, then prints the step and "
        "the --resume command. Needs the job token.",
    )
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--node", type=int, help="plan node to drain")
    which.add_argument("--all", action="store_true",
                       help="stop the whole job at the next step boundary with a checkpoint there (what the first "
                       "Ctrl-C to `elastic run` does); waits until the checkpoint is complete")
    add_job_arguments(parser, wait=60.0)
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from elastic.coordinator.generations import Generations
    from elastic.records.generation import GenerationRecord
    from elastic.records.injection_requests import InjectionRequest, request_id, submit_request

    if args.node is not None and args.node < 0:
        raise UsageError(f"--node must be >= 0, got {args.node}")
    try:
        job = OperatorJob(args)
    except JobError as exc:
        print(f"elastic drain: error: {exc}", file=sys.stderr, flush=True)
        return 1
    try:
        if args.all:
            return _stop_all(job, args.wait)
        gen = Generations(job.client, job.keys).current()
        if gen is None:
            raise JobError(f"job {job.keys.job} has not published its first generation yet")
        record = GenerationRecord.from_json(gen.plan)
        if args.node not in record.incarnations:
            raise JobError(
                f"node {args.node} is not in generation {gen.number} of job {job.keys.job} "
                f"(nodes {sorted(record.incarnations)})"
            )
        req = InjectionRequest(
            id=request_id("drain", args.node, None), kind="drain", node=args.node,
            incarnation=record.incarnations[args.node], requested_at=time.time(), by="cli",
        )
        submit_request(job.client, job.keys.root, req)
        print(
            f"elastic drain: {req.id}: drain node {args.node} (incarnation {req.incarnation}) of job "
            f"{job.keys.job}, now in generation {gen.number}",
            flush=True,
        )
        return job.report_outcome(req.id, args.wait, command="drain", pending="not answered yet", say_running=False)
    except JobError as exc:
        print(f"elastic drain: error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        job.close()


# ---- --all: a whole-job stop that saves ------------------------------------------------------


def _stop_all(job: OperatorJob, wait: float) -> int:
    """Ask for the job's stop (or join one already asked), then wait for its checkpoint (module doc)."""
    from elastic.coordinator.generations import Generations
    from elastic.records.stop import submit_stop

    if int(job.raw.get("checkpoint_every", 0)) <= 0:
        raise JobError(f"job {job.keys.job} writes no checkpoints (--checkpoint-every 0): a stop would save nothing")
    gen = Generations(job.client, job.keys).current()
    if gen is None:
        raise JobError(f"job {job.keys.job} has not published its first generation yet: nothing to save")
    req, ours = submit_stop(job.client, job.keys, "cli")
    if ours:
        print(f"elastic drain: stop of job {job.keys.job} asked ({job.committed_steps()} steps committed, generation "
              f"{gen.number}): it finishes the step in flight and every worker writes a checkpoint at that step "
              "boundary", flush=True)
    else:
        print(f"elastic drain: a stop of job {job.keys.job} was already asked ({req.words()}); waiting for it",
              flush=True)
    return 0 if wait == 0 else _wait_stopped(job, wait)


def _wait_stopped(job: OperatorJob, wait: float) -> int:
    """Wait up to `wait` s until the checkpoint of the stop is complete: on disk when this host sees
    the checkpoint directory, else when every worker reported done (etcd). 0 (also when still
    pending), or JobError when the job's etcd went away before the leader decided the stop."""
    from elastic.coordinator.client import etcd_unreachable, stop_retrying
    from elastic.engine.checkpoint.files import complete_steps
    from elastic.records.stop import StopPoint, read_stop_point, workers_not_done

    directory = Path(job.raw.get("checkpoint_dir") or f"{job.raw['spec']['run_dir']}/checkpoints")
    deadline = time.monotonic() + wait
    point: StopPoint | None = None
    while True:
        try:
            if point is None and (point := read_stop_point(job.client, job.keys)) is not None:
                print(f"elastic drain: job {job.keys.job} stops after step {point.step} (generation {point.generation}): "
                      f"every worker writes its checkpoint of step {point.step}", flush=True)
            on_disk = point is not None and point.step in complete_steps(
                directory, num_layers=point.plan.num_layers, tp_degree=point.plan.gpus_per_node)
            if point is not None and (on_disk or not workers_not_done(job.client, job.keys, point.plan)):
                print(f"elastic drain: job {job.keys.job} stopped at step {point.step}, checkpoint complete in "
                      f"{directory}; resume with: elastic run --resume {job.raw['spec']['run_dir']} (and the run's "
                      "other flags)", flush=True)
                return 0
        except Exception as exc:
            if not etcd_unreachable(exc):
                raise
            if point is None:
                raise JobError(f"the job's etcd stopped answering before the stop was decided: {exc}") from None
            stop_retrying(job.client)  # the launcher ended its job's etcd: the disk alone says the rest
        if time.monotonic() >= deadline:
            print(f"elastic drain: job {job.keys.job}'s stop is not complete after {wait:g} s (still pending)", flush=True)
            return 0
        time.sleep(0.1)
