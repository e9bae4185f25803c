"""Baseline: torchrun elastic restart + plain DDP + a checkpoint every K steps.

Run by `run_ddp_restart` (the driver, in the bench process) as
`torchrun --nnodes=1 --nproc-per-node=P --max-restarts=R --rdzv-backend=c10d` over this file
(the worker). On one host, torchrun's elastic agent answers a worker's death by stopping the
whole local worker group, re-running the rendezvous and starting every worker again; each
worker then reloads the latest checkpoint (rank 0 writes it every K committed steps, atomically)
and trains on. A kill is a real SIGKILL: the i-th kill `(rank, step)` fires in the i-th
attempt (TORCHELASTIC_RESTART_COUNT == i) when that rank starts `step`, after it logged the
time. Rank 0 logs every committed step, so the driver can measure kill -> next committed step,
kill -> the killed step committed again, and the committed steps redone (steps lost).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True, kw_only=True)
class DdpRestartConfig:
    """One torchrun + DDP run."""

    model: str
    """Model preset name."""
    procs: int
    """DDP ranks (torchrun --nproc-per-node): the same count as the runtime's worker processes."""
    steps: int
    """Optimizer steps to commit (1-based, as the runtime prints them)."""
    global_batch: int
    """Samples per step, split evenly over the ranks."""
    microbatch: int
    """Samples per microbatch (gradient accumulation over the rest)."""
    checkpoint_every: int = 10
    """Committed steps between checkpoints."""
    kills: tuple[tuple[int, int], ...] = ()
    """(rank, step) pairs: the i-th SIGKILLs `rank` when it starts `step` in attempt i."""
    run_dir: Path
    """Where the event log, checkpoints and torchrun's logs go."""
    timeout_s: float = 1800.0
    """Wall-clock limit of the whole torchrun invocation."""

    def __post_init__(self) -> None:
        if self.global_batch % (self.procs * self.microbatch):
            raise ValueError(
                f"global batch {self.global_batch} is not a multiple of procs x microbatch "
                f"= {self.procs} x {self.microbatch}"
            )
        for rank, step in self.kills:
            if not (0 <= rank < self.procs and 1 <= step <= self.steps):
                raise ValueError(
                    f"kill (rank {rank}, step {step}) outside {self.procs} ranks x {self.steps} steps"
                )


@dataclass(frozen=True, kw_only=True)
class Restart:
    """One kill and the restart that followed it."""

    kill_step: int
    """The step in flight when the worker was killed."""
    loaded_step: int
    """The checkpoint step the restarted workers resumed from (0: the initial state)."""
    steps_lost: int
    """Committed steps redone: kill_step - 1 - loaded_step."""
    next_commit_s: float
    """SIGKILL -> the first step committed after the restart."""
    regain_s: float
    """SIGKILL -> `kill_step` committed (progress regained)."""
    restart_s: float
    """SIGKILL -> the first restarted worker up with torch imported (torchrun's detection, stop, rendezvous, spawn)."""
    load_s: float
    """SIGKILL -> the checkpoint loaded on rank 0."""


@dataclass(frozen=True, kw_only=True)
class DdpRestartRun:
    """What one torchrun invocation produced."""

    restarts: list[Restart]
    losses: list[float] = field(default_factory=list)
    """Rank 0's local loss of each step, from the commit that counted (the last one of each step)."""
    steady_step_s: float
    """Median time between consecutive commits of the first attempt (its first step excluded)."""
    startup_s: float
    """torchrun started -> first commit."""
    train_s: float
    """First commit -> last commit."""
    wall_s: float
    """torchrun started -> torchrun exited."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ddp_restart(config: DdpRestartConfig) -> DdpRestartRun:
    """Run torchrun over this file's worker; raise RuntimeError if it does not finish all steps."""
    from bench.baselines.common import read_events

    started = time.time()
    proc = start_ddp_restart(config)
    try:
        rc = proc.wait(timeout=config.timeout_s)
    finally:
        stop_ddp_restart(proc, config.run_dir)
    ended = time.time()
    log_text = (config.run_dir / "torchrun.log").read_text()
    if rc != 0:
        raise RuntimeError(f"torchrun exited with {rc}; last lines:\n{log_text[-3000:]}")
    return _analyse(read_events(config.run_dir / "events.jsonl"), config, started=started, ended=ended)


def start_ddp_restart(config: DdpRestartConfig, *, max_restarts: int | None = None) -> subprocess.Popen[bytes]:
    """Start torchrun over this file's worker in its own session (`stop_ddp_restart` ends it);
    its workers log to `<run_dir>/events.jsonl`, torchrun to `<run_dir>/torchrun.log`. Restarts
    allowed: one per planned kill unless `max_restarts` says otherwise (kills from outside)."""
    run_dir = config.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    events = run_dir / "events.jsonl"
    events.unlink(missing_ok=True)
    (run_dir / "ckpt").mkdir(exist_ok=True)
    for stale in (run_dir / "ckpt").iterdir():
        stale.unlink()
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    restarts = len(config.kills) if max_restarts is None else max_restarts
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={config.procs}",
        f"--max-restarts={restarts}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}",
        "--monitor-interval=0.1", str(Path(__file__).resolve()),
        "--model", config.model, "--steps", str(config.steps), "--global-batch", str(config.global_batch),
        "--microbatch", str(config.microbatch), "--checkpoint-every", str(config.checkpoint_every),
        "--events", str(events), "--ckpt-dir", str(run_dir / "ckpt"),
        *(a for rank, step in config.kills for a in ("--kill", f"{rank}:{step}")),
    ]
    with open(run_dir / "torchrun.log", "w") as log:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop_ddp_restart(proc: subprocess.Popen[bytes], run_dir: Path) -> None:
    """End torchrun and every worker it started, unless it has exited: SIGTERM (torchrun stops
    its workers), then SIGKILL. torchrun starts each worker in a session of its own, so the
    workers logged in `<run_dir>/events.jsonl` that are still there are SIGKILLed by PID."""
    import psutil

    from bench.baselines.common import read_events

    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15.0)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    me = str(Path(__file__).resolve())
    for event in read_events(run_dir / "events.jsonl"):
        if event["event"] != "start" or "pid" not in event:
            continue
        try:
            worker_proc = psutil.Process(event["pid"])
            if me in worker_proc.cmdline():  # not a recycled PID
                worker_proc.kill()
        except psutil.Error:
            continue


def _analyse(
    events: list[dict[str, Any]], config: DdpRestartConfig, *, started: float, ended: float
) -> DdpRestartRun:
    import statistics

    commits = [e for e in events if e["event"] == "commit"]
    if not commits or commits[-1]["step"] != config.steps:
        raise RuntimeError(f"the run did not commit step {config.steps}: {commits[-1:] or 'no commit'}")
    restarts = []
    for attempt, kill in enumerate(e for e in events if e["event"] == "kill"):
        after = [c for c in commits if c["attempt"] > attempt]
        load = next(e for e in events if e["event"] == "loaded" and e["attempt"] == attempt + 1)
        start = min(e["t"] for e in events if e["event"] == "start" and e["attempt"] == attempt + 1)
        regain = next(c for c in after if c["step"] == kill["step"])
        restarts.append(Restart(
            kill_step=kill["step"], loaded_step=load["step"], steps_lost=kill["step"] - 1 - load["step"],
            next_commit_s=after[0]["t"] - kill["t"], regain_s=regain["t"] - kill["t"],
            restart_s=start - kill["t"], load_s=load["t"] - kill["t"],
        ))
    first = [c["t"] for c in commits if c["attempt"] == 0]
    gaps = (
        [b - a for a, b in zip(first[1:], first[2:], strict=False)] or [first[-1] - first[0]]
        if len(first) > 1
        else [0.0]
    )
    losses = {c["step"]: c["loss"] for c in commits}
    return DdpRestartRun(
        restarts=restarts, losses=[losses[s] for s in range(1, config.steps + 1)],
        steady_step_s=statistics.median(gaps), startup_s=commits[0]["t"] - started,
        train_s=commits[-1]["t"] - commits[0]["t"], wall_s=ended - started,
    )


def worker(args: argparse.Namespace) -> None:
    """One torchrun worker: resume from the latest checkpoint, train, die where told to."""
    import torch
    import torch.distributed as dist

    from bench.baselines.common import append_event, build, read_events, train_step

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    events = Path(args.events)
    append_event(events, event="start", attempt=attempt, rank=rank, pid=os.getpid())
    # A killed rank's node may be away for a while (a kill event's `back_at`, set by a driver
    # whose trace brings the node back later): with a fixed node count the restarted group
    # cannot form before it is back, so its worker joins the rendezvous only then.
    back_at = max((float(e.get("back_at", 0.0)) for e in read_events(events)
                   if e["event"] == "kill" and e["rank"] == rank), default=0.0)
    if back_at > time.time():
        append_event(events, event="away", attempt=attempt, rank=rank, until=back_at)
        time.sleep(back_at - time.time())
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    stage, optimizer, data = build(args.model)
    latest = Path(args.ckpt_dir) / "latest.pt"
    first_step = 1
    if latest.exists():
        state = torch.load(latest, map_location="cpu", weights_only=True)
        stage.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        first_step = int(state["step"]) + 1
    if rank == 0:
        append_event(events, event="loaded", attempt=attempt, step=first_step - 1)
    model = torch.nn.parallel.DistributedDataParallel(stage)
    kills = [tuple(int(v) for v in k.split(":")) for k in args.kill]
    for step in range(first_step, args.steps + 1):
        if attempt < len(kills) and kills[attempt] == (rank, step):
            append_event(events, event="kill", attempt=attempt, rank=rank, step=step)
            os.kill(os.getpid(), signal.SIGKILL)
        loss = train_step(model, stage, optimizer, data, step=step, rank=rank, world=world,
                          global_batch=args.global_batch, microbatch=args.microbatch, no_sync=model.no_sync)
        if rank == 0:
            append_event(events, event="commit", attempt=attempt, step=step, loss=loss)
            if step % args.checkpoint_every == 0:
                tmp = latest.with_suffix(".tmp")
                torch.save({"model": stage.state_dict(), "optim": optimizer.state_dict(), "step": step}, tmp)
                os.replace(tmp, latest)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--global-batch", type=int, required=True)
    parser.add_argument("--microbatch", type=int, required=True)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--events", required=True)
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--kill", action="append", default=[], help="RANK:STEP, once per attempt")
    worker(parser.parse_args())


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
