"""Step time with abortable waits vs plain `work.wait()`, on the same processes and batch.

Every cross-worker wait of a step can go through `elastic.parallel.abort.wait_work`, which
hands a gloo send/receive to a waiter thread and polls the abort flag (gloo cannot cancel an
operation, and its p2p work never reports completion until waited), or straight to
`work.wait()`, which cannot be abandoned. The same worker processes alternate rounds of steps
in generations started with `abort=None` (plain waits) and with an AbortSignal (abortable),
so outside load hits both alike. Prints each median step time and the ratio abortable / plain
(1.00 = no overhead).

    .venv/bin/python bench/abort_overhead.py --stages 2 --pipelines 1 --microbatches 8 --rounds 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from elastic.engine.trainer import Trainer
from elastic.parallel.abort import AbortSignal
from elastic.records.job import JobSpec
from elastic.roles.static_launcher import host_store
from templates.plan import even_plan


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    nodes = args.stages * args.pipelines
    plan = even_plan(
        num_layers=6, nodes=list(range(nodes)), num_pipelines=args.pipelines,
        global_microbatches=args.microbatches * args.pipelines, microbatch_size=args.microbatch,
    )
    spec = JobSpec(model=args.model, plan=plan, steps=0, run_dir=args.out, device="cpu")
    store = dist.TCPStore("127.0.0.1", args.port, is_master=False, timeout=timedelta(seconds=120))
    trainer = Trainer(spec, node=args.node, local_rank=0)
    times: dict[str, list[float]] = {"plain": [], "abortable": []}
    generation = 0
    for _ in range(args.rounds):
        for mode in ("plain", "abortable"):
            abort = AbortSignal() if mode == "abortable" else None
            trainer.start(
                plan=plan, generation=generation, store=store, abort=abort, fetch=None, step=trainer.step
            )
            generation += 1
            for i in range(args.steps + 1):
                report = trainer.commit(trainer.prepare_step())
                if i > 0:  # the first step of a generation sets up connections
                    times[mode].append(report.seconds)
    if trainer.layout.rank == 0:
        Path(args.out, "times.json").write_text(json.dumps(times))
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--stages", type=int, default=2, help="stages per pipeline (one process each)")
    parser.add_argument("--pipelines", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=8, help="microbatches per pipeline")
    parser.add_argument("--microbatch", type=int, default=2, help="samples per microbatch")
    parser.add_argument("--rounds", type=int, default=4, help="alternations plain / abortable")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round and mode")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--node", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    store, port = host_store(timeout_s=120)
    with tempfile.TemporaryDirectory() as out:
        passed = list(sys.argv[1:])
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    *passed,
                    "--worker",
                    "--node",
                    str(n),
                    "--port",
                    str(port),
                    "--out",
                    out,
                ],
                env=env,
            )
            for n in range(args.stages * args.pipelines)
        ]
        try:
            codes = [p.wait(timeout=900) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(codes):
            raise SystemExit(f"a worker failed: exit codes {codes}")
        times = json.loads(Path(out, "times.json").read_text())
    del store
    plain, abortable = statistics.median(times["plain"]), statistics.median(times["abortable"])
    print(
        f"{args.model}, {args.pipelines} pipeline(s) x {args.stages} stages, {args.microbatches} microbatches "
        f"of {args.microbatch}, {len(times['plain'])} steps per mode"
    )
    print(
        f"median step: plain work.wait() {plain * 1000:.1f} ms, abortable wait_work {abortable * 1000:.1f} ms"
    )
    print(f"ratio abortable / plain: {abortable / plain:.3f}")


if __name__ == "__main__":
    main()
