"""What a checkpoint costs each worker with the optimizer sharded (each slice written once, by one of
its owners) against unsharded (each shard written whole by its writer), issue 55.

    PYTHONPATH=. .venv/bin/python bench/sliced_checkpoint.py --model small --pipelines 4 --rounds 5

P one-stage pipelines on P nodes of one worker each (default 4 at f = 1: every layer has 4
holders, its moments 2 slices of 2 owners), real Trainers on threads over gloo, two steps, then
every worker takes its parts of a checkpoint (`Trainer.checkpoint_parts`) and writes them with
its own `CheckpointWriter` into one directory; the two modes alternate within each round. Per
mode: the bytes the busiest worker writes and all of them together, the seconds the training
thread spends (taking the parts and queueing their copies: `save_parts`) and the writer thread's
write, fsync and commit, both of the slowest worker; medians over rounds. The step's figures
match across modes by construction (the same job): `bench/sharded_optimizer.py` measures them.
Before this change the sharded writer gathered the (S - 1) / S of each layer's moments it did not
own over the world group, and no other holder wrote.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from elastic.engine.checkpoint.policy import checkpoint_writer_shards
from elastic.engine.checkpoint.writers import CheckpointWriter
from elastic.engine.optim import OptimConfig
from elastic.engine.trainer import Trainer
from elastic.model.config import get_preset
from elastic.records.job import JobSpec
from templates.plan import even_plan


def one_round(args: argparse.Namespace, mode: str, root: Path) -> dict[str, float]:
    """Bytes and seconds of one checkpoint of the job in `mode` ("off" or "on")."""
    plan = even_plan(num_layers=get_preset(args.model).num_layers, nodes=list(range(args.pipelines)),
                     num_pipelines=args.pipelines, global_microbatches=args.pipelines, microbatch_size=1,
                     fault_tolerance=args.fault_tolerance)
    spec = JobSpec(model=args.model, plan=plan, steps=4, run_dir=str(root / mode), device="cpu",
                   optim=OptimConfig(lr=1e-3, warmup_steps=2, eps=1e-6), shard_optimizer=mode)
    directory = root / mode / "checkpoints"
    directory.mkdir(parents=True)
    store, lock = dist.HashStore(), threading.Lock()
    per_worker: list[tuple[int, float, float]] = []
    errors: list[str] = []

    def run(node: int) -> None:
        try:
            torch.set_num_threads(1)
            t = Trainer(spec, node=node, local_rank=0)
            t.start(plan=plan, generation=1, store=store, abort=None, fetch=None, step=0)
            t.train(2)
            writer = CheckpointWriter(directory, num_layers=plan.num_layers, tp_degree=1)
            writer.warm()
            start = time.perf_counter()
            parts = t.checkpoint_parts(checkpoint_writer_shards(t.layout))
            if parts:
                writer.save_parts(t.step, parts)
            taken = time.perf_counter() - start
            writer.close()
            written = sum(t.numel() * t.element_size() for p in parts for t in p.tensors.values())
            with lock:
                per_worker.append((written, taken, sum(r.write_s for r in writer.records)))
            t.shutdown()
        except BaseException as exc:  # reported below
            errors.append(f"node {node}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=run, args=(n,)) for n in range(args.pipelines)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(600)
    if errors or len(per_worker) != args.pipelines:
        raise SystemExit(f"{mode}: {errors or 'a worker did not finish'}")
    return {"max_bytes": max(b for b, _, _ in per_worker), "total_bytes": sum(b for b, _, _ in per_worker),
            "writers": sum(1 for b, _, _ in per_worker if b), "train_s": max(s for _, s, _ in per_worker),
            "write_s": max(w for _, _, w in per_worker)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pipelines", type=int, default=4, help="one-stage pipelines, one node each (P)")
    parser.add_argument("--fault-tolerance", type=int, default=1, help="f: slices are P // (f + 1)")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    parser.add_argument("--one", choices=("off", "on"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:  # one run, in a process of its own (its trainers' memory goes with it)
        print(json.dumps(one_round(args, args.one, args.dir)))
        return
    got: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
                cmd = [sys.executable, __file__, "--one", mode, "--dir", str(Path(tmp) / f"r{r}"),
                       *(f"--{k}={v}" for k, v in (("model", args.model), ("pipelines", args.pipelines),
                                                    ("fault-tolerance", args.fault_tolerance)))]
                proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=900)
                if proc.returncode:
                    raise SystemExit(f"{mode}, round {r}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
                got[mode].append(json.loads(proc.stdout.strip().splitlines()[-1]))
                shutil.rmtree(Path(tmp) / f"r{r}" / mode)
    med = {m: {k: statistics.median(x[k] for x in rows) for k in rows[0]} for m, rows in got.items()}
    print(f"{args.model}, {args.pipelines} one-stage pipelines, f = {args.fault_tolerance}, median of {args.rounds} rounds")
    print(f"{'':10} {'writers':>8} {'busiest MB':>11} {'all MB':>8} {'train s':>8} {'write s':>8}")
    for m in ("off", "on"):
        x = med[m]
        print(f"{'sharded' if m == 'on' else 'unsharded':10} {x['writers']:8.0f} {x['max_bytes'] / 1e6:11.2f} "
              f"{x['total_bytes'] / 1e6:8.2f} {x['train_s']:8.3f} {x['write_s']:8.3f}")
    print(f"on / off: busiest worker's bytes {med['on']['max_bytes'] / med['off']['max_bytes']:.2f}x, "
          f"training thread {med['on']['train_s'] / med['off']['train_s']:.2f}x, "
          f"write {med['on']['write_s'] / med['off']['write_s']:.2f}x")
    if args.out is not None:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rounds": got,
                                        "median": med}, indent=1))


if __name__ == "__main__":
    main()
