"""Steady-state step time of the engine vs plain DistributedDataParallel, side by side.

Same model, same number of worker processes, same global batch, same microbatch size, one
thread per process. The engine runs P pipelines of one stage each (pure data parallelism
through its own schedule, its bucketed reduction launched during the last backward, as DDP's
is: in the step's summation tree, the default, or by gloo's all-reduce, `exact_grad_sum=False`); DDP runs the same P processes with gradient accumulation
(no_sync on all but the last microbatch) and torch's AdamW. Rounds alternate engine / DDP so
that load from anything else on the machine hits both alike. Prints each median and the ratio
engine / DDP (1.00 = same speed), and the first quartile beside it: on a machine that others
load in bursts the quartile is the steadier figure of the two. Then each round's own ratio (its
engine median over the same round's DDP median) and the median of those: the "median of N"
figure, N = --rounds. DDP's AdamW is torch's default (on CPU, one parameter at a time);
`--ddp-fused` gives it torch's fused kernel, the one the engine's optimizer calls.

`--device cuda`: every process on its own GPU (rank r on device r mod the GPU count), DDP over
NCCL, forward and loss under bf16 autocast (`elastic.engine.device.compute_precision`), as the
engine's workers run; `--device cpu` (the default): gloo and fp32.

`--interleave S`: within each round the three runs are started together and take turns of S
seconds instead of running one after another (bench/turns.py), so a machine whose speed drifts
over tens of seconds hits all three alike.

    .venv/bin/python bench/engine_vs_ddp.py --model tiny --procs 2 --global-batch 16 --microbatch 4
    .venv/bin/python bench/engine_vs_ddp.py --device cuda --model gpt2-124m --procs 2 --global-batch 32 --microbatch 8
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from elastic.data.dataset import TokenDataset, step_sample_indices
from elastic.engine.device import backend_for, compute_precision, select_device
from elastic.engine.optim import OptimConfig, lr_at
from elastic.model.config import get_preset
from elastic.model.gpt import GPTStage
from elastic.records.job import JobSpec
from elastic.roles.static_launcher import host_store, launch
from templates.plan import even_plan

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.turns import in_turns  # noqa: E402

WARMUP_STEPS = 2
"""Steps excluded from the steady-state median (first-touch allocation, connection set-up)."""


def engine_steps(args: argparse.Namespace, run_dir: Path, *, exact: bool) -> list[float]:
    cfg = get_preset(args.model)
    plan = even_plan(
        num_layers=cfg.num_layers,
        nodes=list(range(args.procs)),
        num_pipelines=args.procs,
        global_microbatches=args.global_batch // args.microbatch,
        microbatch_size=args.microbatch,
    )
    spec = JobSpec(
        model=args.model,
        plan=plan,
        steps=args.steps,
        run_dir=str(run_dir),
        device=args.device,
        exact_grad_sum=exact,
        optim=OptimConfig(),
    )
    return launch(spec, quiet=True, timeout_s=600).step_seconds


def ddp_steps(args: argparse.Namespace, run_dir: Path) -> list[float]:
    store, port = host_store(timeout_s=120)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                *sys.argv[1:],
                "--ddp-rank",
                str(r),
                "--ddp-port",
                str(port),
                "--ddp-out",
                str(run_dir / "ddp.json"),
            ],
        )
        for r in range(args.procs)
    ]
    try:
        for p in procs:
            if p.wait(timeout=600) != 0:
                raise RuntimeError(f"DDP worker pid {p.pid} exited with {p.returncode}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        del store
    return json.loads((run_dir / "ddp.json").read_text())


def ddp_worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    rank, world = args.ddp_rank, args.procs
    device = select_device(rank, want=args.device)
    on_cpu = device.type == "cpu"
    if not on_cpu:
        torch.accelerator.set_device_index(device.index)
    store = dist.TCPStore("127.0.0.1", args.ddp_port, is_master=False, timeout=timedelta(seconds=120))
    dist.init_process_group(backend_for(device), store=dist.PrefixStore("ddp", store), rank=rank, world_size=world,
                            device_id=None if on_cpu else device)
    cfg = get_preset(args.model)
    model = torch.nn.parallel.DistributedDataParallel(
        GPTStage(cfg, device=device), device_ids=None if on_cpu else [device]
    )
    optim_cfg = OptimConfig()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": optim_cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=optim_cfg.lr, betas=optim_cfg.betas, eps=optim_cfg.eps, fused=True if args.ddp_fused else None,
    )
    data = TokenDataset(seq_len=cfg.seq_len)
    per_rank = args.global_batch // world
    local_mbs = per_rank // args.microbatch
    times = []
    for step in range(args.steps):
        start = time.perf_counter()
        samples = step_sample_indices(step, args.global_batch)[rank * per_rank : (rank + 1) * per_rank]
        optimizer.zero_grad(set_to_none=True)
        for m in range(local_mbs):
            x, y = data.batch(samples[m * args.microbatch : (m + 1) * args.microbatch])
            x, y = x.to(device), y.to(device)
            sync = m == local_mbs - 1
            with contextlib.nullcontext() if sync else model.no_sync():
                with compute_precision(device):
                    loss = model.module.loss(model(x, dropout_key=m), y) / local_mbs
                loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), optim_cfg.grad_clip)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, optim_cfg)
        optimizer.step()
        if not on_cpu:  # the step's kernels are queued, not done: wait for them before reading the clock
            torch.accelerator.synchronize(device)
        times.append(time.perf_counter() - start)
    dist.barrier()
    if rank == 0:
        Path(args.ddp_out).write_text(json.dumps(times))
    dist.destroy_process_group()


def run_round(args: argparse.Namespace, base: Path) -> dict[str, list[float]]:
    """One round's three runs, one after another or taking turns (`args.interleave`); each run's
    step times by name, the warm-up steps left out."""
    runs: dict[str, tuple[str, Callable[[], list[float]]]] = {
        "engine (tree sums)": (str(base / "tree"), lambda: engine_steps(args, base / "tree", exact=True)),
        "engine (gloo all-reduce)": (str(base / "ring"), lambda: engine_steps(args, base / "ring", exact=False)),
        "DDP": (str(base / "ddp.json"), lambda: ddp_steps(args, base)),
    }
    if args.interleave > 0:
        done = in_turns(runs, args.interleave)
    else:
        done = {name: fn() for name, (_, fn) in runs.items()}
    return {name: done[name][WARMUP_STEPS:] for name in runs}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: one GPU per process, DDP on NCCL, bf16 autocast; cpu: gloo, fp32 (default)")
    parser.add_argument("--procs", type=int, default=2, help="worker processes (= pipelines / DDP ranks)")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--microbatch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2, help="alternating engine/DDP rounds")
    parser.add_argument("--ddp-fused", action="store_true",
                        help="DDP's AdamW with fused=True (torch's default on CPU is one parameter at a time; the "
                             "engine's optimizer calls the fused kernel)")
    parser.add_argument("--interleave", type=float, default=0.0, metavar="S",
                        help="run each round's three runs at once, taking turns every S seconds (module doc); "
                             "0: one after another")
    parser.add_argument("--ddp-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--ddp-port", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--ddp-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ddp_rank is not None:
        ddp_worker(args)
        return
    if args.global_batch % (args.procs * args.microbatch):
        raise SystemExit("--global-batch must be a multiple of --procs x --microbatch")
    results: dict[str, list[float]] = {
        "engine (tree sums)": [],
        "engine (gloo all-reduce)": [],
        "DDP": [],
    }
    per_round: dict[str, list[float]] = {name: [] for name in results}
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        for r in range(args.rounds):
            base = Path(tmp) / f"round{r}"
            base.mkdir()
            this = run_round(args, base)
            for name, times in this.items():
                results[name] += times
                per_round[name].append(statistics.median(times) / statistics.median(this["DDP"]))
    ddp = statistics.median(results["DDP"])
    print(
        f"model {args.model}, {args.procs} processes, global batch {args.global_batch}, "
        f"microbatch {args.microbatch}, {args.rounds} rounds x {args.steps - WARMUP_STEPS} steady steps, "
        f"DDP's AdamW {'fused' if args.ddp_fused else 'torch default'}"
        + ("" if args.device == "cpu" else f", device {args.device} (DDP on NCCL, bf16 autocast)")
        + (f", in turns of {args.interleave:g} s" if args.interleave > 0 else "")
    )
    for name, times in results.items():
        med = statistics.median(times)
        q1, ddp_q1 = statistics.quantiles(times, n=4)[0], statistics.quantiles(results["DDP"], n=4)[0]
        print(f"  {name:26s} median step {med * 1000:8.1f} ms   ratio vs DDP {med / ddp:5.3f}"
              f"   (first quartile {q1 * 1000:6.1f} ms, ratio {q1 / ddp_q1:5.3f})")
    print(f"ratio vs DDP per round, and the median of the {args.rounds} rounds:")
    for name, ratios in per_round.items():
        if name != "DDP":
            print(f"  {name:26s} {'  '.join(f'{x:5.3f}' for x in ratios)}   median {statistics.median(ratios):5.3f}")


if __name__ == "__main__":
    main()
