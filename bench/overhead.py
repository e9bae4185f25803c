"""Failure-free step time: this engine vs plain DDP and vs torch.distributed.pipelining.

    .venv/bin/python bench/overhead.py --model tiny --procs 2 --global-batch 16 --microbatch 4 --repeats 3

Same model, same P worker processes (one thread each), same global batch and microbatch size
on every side; each side is one fresh launch per round, and rounds run the sides in turn so
that outside load hits them alike. Medians are over each run's steps after the first 2.
`--interleave S`: a round's sides are started together and take turns of S seconds, the others
held with SIGSTOP (bench/turns.py), so a machine whose speed drifts hits them alike.

- data parallel: the engine with P pipelines of one stage (bench/engine_vs_ddp.py's run) vs
  `DistributedDataParallel` with gradient accumulation (engine_vs_ddp.py's DDP worker).
- pipeline parallel: the engine with one pipeline of P stages vs `torch.distributed.pipelining`
  `Schedule1F1B` with the same P stages (the same layer split), and
  `ScheduleInterleaved1F1B` with 2 stages per process (the model split in 2P), all with
  torch AdamW after a global grad-norm clip.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.section import Section, attempt, series  # noqa: E402
from bench.stats import Figure  # noqa: E402
from bench.turns import in_turns  # noqa: E402

WARMUP_STEPS = 2
"""Steps excluded from each run's median."""


def _spawn(
    procs: int, argv: list[str], out: Path, *, flags: tuple[str, str] = ("--rank", "--port")
) -> list[float]:
    """Start `procs` ranks of `argv` (given their rank and the store's port through `flags`) around
    a fresh TCPStore; rank 0's step times, read from `out`."""
    from elastic.roles.static_launcher import host_store

    store, port = host_store(timeout_s=300)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    children = [subprocess.Popen([sys.executable, *argv, flags[0], str(r), flags[1], str(port)], env=env)
                for r in range(procs)]
    try:
        for p in children:
            if p.wait(timeout=900) != 0:
                raise RuntimeError(f"{argv[0]} rank pid {p.pid} exited with {p.returncode}")
    finally:
        for p in children:
            if p.poll() is None:
                p.kill()
                p.wait()
        del store
    return list(json.loads(out.read_text()))


def ddp_run(args: argparse.Namespace, out: Path) -> list[float]:
    """bench/engine_vs_ddp.py's DDP worker over the same processes and batch."""
    argv = [str(REPO / "bench" / "engine_vs_ddp.py"), "--model", args.model, "--procs", str(args.procs),
            "--global-batch", str(args.global_batch), "--microbatch", str(args.microbatch),
            "--steps", str(args.steps), "--ddp-out", str(out)]
    return _spawn(args.procs, argv, out, flags=("--ddp-rank", "--ddp-port"))


def engine_run(args: argparse.Namespace, run_dir: Path, *, pipelines: int) -> list[float]:
    """The engine over P processes as `pipelines` pipelines of P / pipelines stages."""
    from elastic.engine.optim import OptimConfig
    from elastic.model.config import get_preset
    from elastic.records.job import JobSpec
    from elastic.roles.static_launcher import launch
    from templates.plan import even_plan

    plan = even_plan(num_layers=get_preset(args.model).num_layers, nodes=list(range(args.procs)),
                     num_pipelines=pipelines, global_microbatches=args.global_batch // args.microbatch,
                     microbatch_size=args.microbatch)
    spec = JobSpec(model=args.model, plan=plan, steps=args.steps, run_dir=str(run_dir), device="cpu",
                   optim=OptimConfig())
    return launch(spec, quiet=True, timeout_s=900).step_seconds


def pp_run(args: argparse.Namespace, out: Path, *, schedule: str) -> list[float]:
    argv = [__file__, "--pp-worker", schedule, "--model", args.model, "--procs", str(args.procs),
            "--global-batch", str(args.global_batch), "--microbatch", str(args.microbatch),
            "--steps", str(args.steps), "--out", str(out)]
    return _spawn(args.procs, argv, out)


def pp_worker(args: argparse.Namespace) -> None:
    """One rank of a torch.distributed.pipelining run over the engine's layer split."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    from elastic.data.dataset import TokenDataset, step_sample_indices
    from elastic.engine.optim import OptimConfig, lr_at
    from elastic.model.config import get_preset
    from elastic.model.gpt import GPTStage
    from templates.plan import even_plan

    torch.set_num_threads(1)
    rank, world = args.rank, args.procs
    store = dist.TCPStore("127.0.0.1", args.port, is_master=False, timeout=timedelta(seconds=300))
    dist.init_process_group("gloo", store=dist.PrefixStore("pp", store), rank=rank, world_size=world)
    cfg = get_preset(args.model)
    per_rank = 2 if args.pp_worker == "interleaved" else 1
    n_stages = world * per_rank
    split = even_plan(num_layers=cfg.num_layers, nodes=list(range(n_stages)), num_pipelines=1,
                      global_microbatches=1, microbatch_size=1).pipelines[0].stages
    # Interleaved: rank r holds stages r, r + world, ... (the looping placement torch expects).
    ids = [rank + k * world for k in range(per_rank)]
    modules = [GPTStage(cfg, first=split[i].layers[0], last=split[i].layers[1]) for i in ids]
    stages: list[Any] = [
        PipelineStage(m, i, n_stages, torch.device("cpu")) for m, i in zip(modules, ids, strict=True)
    ]
    n_mb = args.global_batch // args.microbatch
    last = modules[-1] if ids[-1] == n_stages - 1 else None

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        assert last is not None
        return last.loss(logits, target)

    schedule: Schedule1F1B | ScheduleInterleaved1F1B
    if args.pp_worker == "interleaved":
        schedule = ScheduleInterleaved1F1B(stages, n_microbatches=n_mb, loss_fn=loss_fn)
    else:
        schedule = Schedule1F1B(stages[0], n_microbatches=n_mb, loss_fn=loss_fn)
    optim_cfg = OptimConfig()
    params = [p for m in modules for p in m.parameters()]
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": optim_cfg.weight_decay},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=optim_cfg.lr, betas=optim_cfg.betas, eps=optim_cfg.eps,
    )
    data = TokenDataset(seq_len=cfg.seq_len)
    times = []
    for step in range(args.steps):
        start = time.perf_counter()
        x, y = data.batch(step_sample_indices(step, args.global_batch))
        optimizer.zero_grad(set_to_none=True)
        if 0 in ids:
            schedule.step(x, target=y if last is not None else None)
        elif last is not None:
            schedule.step(target=y)
        else:
            schedule.step()
        # Global gradient norm over every stage, then the same clip the engine applies.
        sq = torch.stack([p.grad.pow(2).sum() for p in params if p.grad is not None]).sum()
        dist.all_reduce(sq)
        scale = min(1.0, optim_cfg.grad_clip / (float(sq.sqrt()) + 1e-6))
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, optim_cfg)
        optimizer.step()
        times.append(time.perf_counter() - start)
    dist.barrier()
    if rank == 0:
        Path(args.out).write_text(json.dumps(times))
    dist.destroy_process_group()


def run_side(side: str, args: argparse.Namespace, base: Path) -> list[float]:
    """Rank 0's step times of one run of `side` (one of SIDES)."""
    where = base / MARKERS[side]
    if side == "engine DP":
        return engine_run(args, where, pipelines=args.procs)
    if side == "DDP":
        return ddp_run(args, where)
    if side == "engine PP":
        return engine_run(args, where, pipelines=1)
    if side == "torch 1F1B":
        return pp_run(args, where, schedule="1f1b")
    assert side == "torch interleaved 1F1B", side
    return pp_run(args, where, schedule="interleaved")


def _import_sides() -> None:
    """Import what the sides import lazily (run_side's functions), on this thread."""
    import elastic.engine.optim  # noqa: F401
    import elastic.model.config  # noqa: F401
    import elastic.records.job  # noqa: F401
    import elastic.roles.static_launcher  # noqa: F401
    import templates.plan  # noqa: F401


SIDES = ("engine DP", "DDP", "engine PP", "torch 1F1B", "torch interleaved 1F1B")
MARKERS = {"engine DP": "edp", "DDP": "ddp.json", "engine PP": "epp", "torch 1F1B": "1f1b.json",
           "torch interleaved 1F1B": "il.json"}
"""Per side, its run's path under a round's directory: only that side's processes are given it,
so it tells them apart (bench/turns.py)."""


def measure(*, model: str, procs: int, global_batch: int, microbatch: int, steps: int, repeats: int,
            root: Path, interleave_s: float = 0.0) -> Section:
    """Rounds of every side; a Section with medians (ms) and per-round ratios. `interleave_s`: a
    round's sides take turns of that many seconds (0: one after another)."""
    if global_batch % (procs * microbatch):
        raise ValueError(
            f"global batch {global_batch} must be a multiple of procs x microbatch = {procs * microbatch}"
        )
    args = argparse.Namespace(
        model=model, procs=procs, global_batch=global_batch, microbatch=microbatch, steps=steps
    )
    section = Section(title="Failure-free step time: engine vs DDP vs torch.distributed.pipelining")
    section.notes.append(f"{model}, {procs} processes x 1 thread, global batch {global_batch}, microbatch "
                         f"{microbatch}, median of steps {WARMUP_STEPS + 1}..{steps} of each run"
                         + (f", the sides of a round in turns of {interleave_s:g} s" if interleave_s > 0 else ""))
    started = time.time()
    figures: dict[str, Figure] = {}
    for r in range(repeats):
        base = root / f"round{r}"
        base.mkdir(parents=True, exist_ok=True)
        med: dict[str, float] = {}
        order = SIDES[r % len(SIDES) :] + SIDES[: r % len(SIDES)]
        runs = {side: partial(attempt, f"{side} round {r}", partial(run_side, side, args, base), section)
                for side in order}
        if interleave_s > 0:
            _import_sides()  # before the sides' threads: two threads' first imports of torch race
            done = in_turns({side: (str(base / MARKERS[side]), fn) for side, fn in runs.items()}, interleave_s)
        else:
            done = {side: fn() for side, fn in runs.items()}
        for side in order:
            times = done[side]
            if times is None:
                continue
            med[side] = statistics.median(times[WARMUP_STEPS:])
            section.raw.append({"round": r, "side": side, "median_step_s": med[side]})
            print(f"  overhead round {r} {side}: {med[side] * 1000:.1f} ms", file=sys.stderr, flush=True)
        for side in SIDES:
            if side in med:
                series(figures, f"step time: {side}", "ms", med[side] * 1000)
        for num, den in (
            ("engine DP", "DDP"),
            ("engine PP", "torch 1F1B"),
            ("engine PP", "torch interleaved 1F1B"),
        ):
            if num in med and den in med:
                series(figures, f"ratio {num} / {den}", "x", med[num] / med[den])
    section.figures = list(figures.values())
    section.wall_s = time.time() - started
    return section


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--microbatch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--interleave", type=float, default=0.0, metavar="S",
                        help="a round's sides take turns of S seconds (module doc); 0: one after another")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--pp-worker", choices=["1f1b", "interleaved"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.pp_worker:
        pp_worker(args)
        return
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        section = measure(model=args.model, procs=args.procs, global_batch=args.global_batch,
                          microbatch=args.microbatch, steps=args.steps, repeats=args.repeats, root=Path(tmp),
                          interleave_s=args.interleave)
    print("\n".join(section.lines()))
    if args.json:
        args.json.write_text(json.dumps(section.to_dict(), indent=1))


if __name__ == "__main__":
    main()
