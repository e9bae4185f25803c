"""`python -m tests.comm.batch --first N --count K --out FILE`: run the generated jobs of seeds
[N, N+K) (tests/comm/cluster.py), check each under the model of NCCL and against the one-process
run, and write one JSON line per job. In a process of its own: each job leaves gloo threads
behind (groups live as long as their trainers' reference cycles), which must not slow the rest
of the test suite."""

from __future__ import annotations

import argparse
import faulthandler
import functools
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

import torch

from elastic.comm.nccl_model import check
from elastic.model.config import GPTConfig
from elastic.transfer.shards import ShardKey
from tests.comm.cluster import Case, Outcome, random_case, reference_shards, run_case
from tests.comm.patterns import features

JOB_HANG_S = 200


@functools.cache
def _reference(tp: int, microbatches: int, sp: bool, root: Path, shape: GPTConfig) -> dict[ShardKey, dict[str, torch.Tensor]]:
    return reference_shards(tp, microbatches, root / f"ref-{shape.arch}-tp{tp}-m{microbatches}-sp{sp:d}",
                            sequence_parallel=sp, shape=shape)


def differences(case: Case, outcome: Outcome, root: Path) -> list[str]:
    """Where the shards every worker holds after the job differ from the one-process run's."""
    want = _reference(case.plan1.gpus_per_node, case.plan1.global_microbatches,
                      case.sequence_parallel and case.plan1.gpus_per_node > 1, root, case.shape)
    held = {key for mine in outcome.shards.values() for key in mine}
    if held != set(want):
        return [f"shards held {sorted(held)}, want {sorted(want)}"]
    out = []
    for worker, mine in outcome.shards.items():
        for key, state in mine.items():
            bad = sorted(n for n, t in want[key].items() if n not in state or not torch.equal(state[n], t))
            if bad:
                out.append(f"worker {worker} shard {tuple(key)}: {bad}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--first", type=int, required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    try:
        _run(args.first, args.count, args.out)
    except BaseException:  # a job's harness failed (not its checks): say where, and exit at once
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    # Skip interpreter teardown, as the runtime's workers do (roles/elastic_worker.py): the jobs'
    # gloo groups, still alive in their trainers' cycles, may abort the process in their
    # destructors at exit ("terminate called without an active exception", seen once in CI), or
    # hang there behind a job's stuck threads.
    print(f"batch of {args.count} jobs from seed {args.first}: done", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(0)


def _run(first: int, count: int, path: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp, path.open("w") as out:
        root = Path(tmp)
        for seed in range(first, first + count):
            case = random_case(seed)
            print(f"job of seed {seed} (tests.comm.cluster.random_case)", file=sys.stderr, flush=True)
            # A job bounded by its timeouts ends within about 2 x 60 s; past JOB_HANG_S it hangs
            # where no timeout reaches: every thread's stack to stderr, and the batch exits.
            faulthandler.dump_traceback_later(JOB_HANG_S, exit=True)
            outcome = run_case(case, root / case.name, timeout_s=60)
            faulthandler.cancel_dump_traceback_later()
            report = check(outcome.logs)
            line = {
                "case": str(case), "errors": outcome.errors, "steps": sorted(set(outcome.steps.values())),
                "nccl": [] if report.ok else [report.describe()], "events": report.events,
                "differences": [] if outcome.errors else differences(case, outcome, root),
                "features": sorted(features(case, outcome.logs)),
            }
            out.write(json.dumps(line) + "\n")
            out.flush()


if __name__ == "__main__":
    main()
