"""`elastic drain --node N`: remove a node from a running elastic job at a step boundary.

The request goes into the job's etcd (`injections/<id>`, kind drain); the leader refuses it if
the other nodes cannot form the job's f+1 pipelines, else publishes a generation without the
node ("drained node N"). The node's workers serve their shards until the survivors have them,
then exit 0; no failure is reported. Exit codes: 0 drained (or still pending after `--wait`),
1 refused or the job cannot take it (see inject_cmd.py), 2 bad flags.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from elastic.cli.inject_cmd import JobError, OperatorJob, add_job_arguments
from elastic.cli.main import UsageError


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "drain",
        help="remove a node from a running elastic job at a step boundary (no failure)",
        description="Ask the leader of a running elastic job to take a node out at the next step boundary: "
        "a new generation without it is published, its workers hand their shards over and exit 0. Refused "
        "if the other nodes cannot form the job's f+1 pipelines. Needs the job token.",
    )
    parser.add_argument("--node", type=int, required=True, help="plan node to drain")
    add_job_arguments(parser, wait=60.0)
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from elastic.coordinator.generations import Generations
    from elastic.records.injection import InjectionRequest, request_id, submit_request
    from elastic.records.protocol import GenerationRecord

    if args.node < 0:
        raise UsageError(f"--node must be >= 0, got {args.node}")
    try:
        job = OperatorJob(args)
    except JobError as exc:
        print(f"elastic drain: error: {exc}", file=sys.stderr, flush=True)
        return 1
    try:
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
