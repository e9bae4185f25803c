"""Baseline: torchft replica groups (PyPI torchft 0.2.0) recovering from a peer, on CPU/gloo.

Each "node" is one replica group of one process: a torchft `Manager` (its own TCPStore on
127.0.0.1, `ProcessGroupGloo`), torchft's `DistributedDataParallel` and `OptimizerWrapper`
around the same GPT and AdamW settings as the engine. A `LighthouseServer` on 127.0.0.1 in the
driver process forms the quorums. A kill is a real SIGKILL of one replica's process when it
starts a given step (as the runtime numbers steps: the one after `manager.current_step()`);
the survivors' in-flight step fails its all-reduce or `should_commit`, a new quorum forms
without the lost replica and training goes on. The driver then restarts the killed replica
(what torchx or a cluster scheduler would do); it joins the next quorum and heals from a peer's
live state over torchft's HTTP checkpoint transport.

Differences from the runtime to keep in mind when reading the figures: torchft's replicas are
data-parallel copies of the whole model (no pipeline stages), and while a replica is missing
the step averages over the participants only (a smaller effective batch), where the runtime
keeps the global batch fixed.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

OP_TIMEOUT_S = 600
"""torchft's operation and quorum timeouts: 60 s by default, but gpt2-124m's steps take 20-45 s
on 2 CPU cores and a quorum waits for the slowest replica's step, so 60 s timed out there."""
HEARTBEAT_TIMEOUT_MS = 3000
"""Lighthouse heartbeat timeout: the runtime's etcd lease TTL (3 s), so both sides get the same
hang-detection budget (torchft's default is 5 s)."""


@dataclass(frozen=True, kw_only=True)
class TorchftConfig:
    """One torchft run."""

    model: str
    """Model preset name."""
    replicas: int
    """Replica groups (one process each): the same count as the runtime's worker processes."""
    steps: int
    """Steps to commit."""
    global_batch: int
    """Samples per step with every replica present (each replica takes 1/replicas of it)."""
    microbatch: int
    """Samples per microbatch."""
    kills: tuple[tuple[int, int], ...] = ()
    """(replica, step) pairs, in order: SIGKILL `replica` when it starts `step`; restarted at once."""
    run_dir: Path
    """Where the event log and the replicas' logs go."""
    timeout_s: float = 1800.0
    """Wall-clock limit of the run."""

    def __post_init__(self) -> None:
        if self.global_batch % (self.replicas * self.microbatch):
            raise ValueError(
                f"global batch {self.global_batch} is not a multiple of replicas x microbatch "
                f"= {self.replicas} x {self.microbatch}"
            )
        if self.replicas < 2:
            raise ValueError("torchft needs at least 2 replicas to survive a loss")


@dataclass(frozen=True, kw_only=True)
class PeerRecovery:
    """One kill of a replica and what followed."""

    kill_step: int
    """The step the killed replica was starting."""
    steps_lost: int
    """Committed steps redone: steps a replica committed again after the kill (0 unless a rollback)."""
    next_commit_s: float
    """SIGKILL -> the first step committed by a survivor."""
    rejoin_s: float
    """SIGKILL -> the first step committed by the restarted replica (after healing from a peer)."""


@dataclass(frozen=True, kw_only=True)
class TorchftRun:
    """What one torchft run produced."""

    recoveries: list[PeerRecovery]
    steady_step_s: float
    """Median time between consecutive commits of replica 0 before the first kill (first excluded)."""
    startup_s: float
    """Driver start -> first commit."""
    train_s: float
    """First commit -> last commit of replica 0."""
    wall_s: float
    """Driver start -> every replica done."""
    commit_times: list[float] = field(default_factory=list)
    """Wall time of each of replica 0's commits."""


def run_torchft(config: TorchftConfig) -> TorchftRun:
    """Run the replicas under a local lighthouse; RuntimeError if a replica fails for another reason."""
    from torchft.coordination import LighthouseServer

    from bench.baselines.common import read_events

    run_dir = config.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    events = run_dir / "events.jsonl"
    events.unlink(missing_ok=True)
    stop = run_dir / "stop"
    stop.unlink(missing_ok=True)
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=config.replicas - 1,
                                  join_timeout_ms=2000, heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHFT_LIGHTHOUSE": lighthouse.address(),
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}

    def spawn(replica: int, attempt: int) -> subprocess.Popen[bytes]:
        kills = [f"{step}" for r, step in config.kills if r == replica][attempt : attempt + 1]
        cmd = [sys.executable, str(Path(__file__).resolve()), "--replica", str(replica),
               "--replicas", str(config.replicas), "--model", config.model, "--steps", str(config.steps),
               "--global-batch", str(config.global_batch), "--microbatch", str(config.microbatch),
               "--events", str(events), "--attempt", str(attempt), *(("--kill-step", kills[0]) if kills else ())]
        log = open(run_dir / f"replica{replica}-{attempt}.log", "wb")  # noqa: SIM115 (closed with the process)
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)

    started = time.time()
    attempts = dict.fromkeys(range(config.replicas), 0)
    procs = {r: spawn(r, 0) for r in range(config.replicas)}
    try:
        while procs:
            if time.time() - started > config.timeout_s:
                raise TimeoutError(f"torchft run did not finish in {config.timeout_s} s")
            for r, p in list(procs.items()):
                rc = p.poll()
                if rc is None:
                    continue
                del procs[r]
                if rc == -signal.SIGKILL and attempts[r] < sum(1 for k, _ in config.kills if k == r):
                    attempts[r] += 1
                    procs[r] = spawn(r, attempts[r])
                elif rc != 0:
                    tail = (run_dir / f"replica{r}-{attempts[r]}.log").read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"torchft replica {r} exited with {rc}:\n{tail}")
            if not stop.exists():
                _maybe_stop(read_events(events), config, stop)
            time.sleep(0.05)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        lighthouse.shutdown()
    return _analyse(read_events(events), started=started, ended=time.time())


def _maybe_stop(events: list[dict[str, Any]], config: TorchftConfig, stop: Path) -> None:
    """Once every killed replica is back (committed after its restart) and `steps` are committed,
    tell the replicas to stop 3 steps later: far enough ahead that every replica reads the same
    stop step before reaching it (they run in lockstep, within one step of each other)."""
    commits = [e for e in events if e["event"] == "commit"]
    if not commits or max(c["step"] for c in commits) < config.steps:
        return
    for kill in (e for e in events if e["event"] == "kill"):
        if not any(c["replica"] == kill["replica"] and c["t"] > kill["t"] for c in commits):
            return
    if len([e for e in events if e["event"] == "kill"]) < len(config.kills):
        return
    tmp = stop.with_suffix(".tmp")
    tmp.write_text(str(max(c["step"] for c in commits) + 3))
    os.replace(tmp, stop)


def _analyse(events: list[dict[str, Any]], *, started: float, ended: float) -> TorchftRun:
    import statistics

    commits = [e for e in events if e["event"] == "commit"]
    kills = [e for e in events if e["event"] == "kill"]
    recoveries = []
    for kill in kills:
        after = [c for c in commits if c["t"] > kill["t"]]
        # A survivor may still log the commit of kill_step - 1 just after the kill: that step
        # was agreed before the kill. The next commit is the first of a step >= kill_step.
        survivor = next(c for c in after if c["replica"] != kill["replica"] and c["step"] >= kill["step"])
        back = next(c for c in after if c["replica"] == kill["replica"])
        done = {(c["replica"], c["step"]) for c in commits if c["t"] <= kill["t"]}
        redone = {c["step"] for c in after if (c["replica"], c["step"]) in done}
        recoveries.append(PeerRecovery(kill_step=kill["step"], steps_lost=len(redone),
                                       next_commit_s=survivor["t"] - kill["t"], rejoin_s=back["t"] - kill["t"]))
    first_kill = kills[0]["t"] if kills else float("inf")
    mine = [c["t"] for c in commits if c["replica"] == 0]
    before = [t for t in mine if t < first_kill]
    gaps = [b - a for a, b in zip(before[1:], before[2:], strict=False)] or [0.0]
    return TorchftRun(recoveries=recoveries, steady_step_s=statistics.median(gaps), startup_s=min(mine) - started,
                      train_s=max(mine) - min(mine), wall_s=ended - started, commit_times=mine)


def worker(args: argparse.Namespace) -> None:
    """One replica group of one process."""
    import torch
    from torchft import DistributedDataParallel, Manager, ProcessGroupGloo
    from torchft.optim import OptimizerWrapper

    from bench.baselines.common import append_event, build, train_step

    events = Path(args.events)
    append_event(events, event="start", replica=args.replica, attempt=args.attempt)
    torch.set_num_threads(1)
    stage, optimizer, data = build(args.model)
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def load_state_dict(state: dict[str, Any]) -> None:
        stage.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=OP_TIMEOUT_S)), load_state_dict=load_state_dict,
        state_dict=lambda: {"model": stage.state_dict(), "optim": optimizer.state_dict()},
        min_replica_size=args.replicas - 1, replica_id=f"replica{args.replica}", store_addr="127.0.0.1",
        store_port=store.port, rank=0, world_size=1, hostname="127.0.0.1", timeout=timedelta(seconds=OP_TIMEOUT_S),
        quorum_timeout=timedelta(seconds=OP_TIMEOUT_S),
    )
    model = DistributedDataParallel(manager, stage)
    wrapped = OptimizerWrapper(manager, optimizer)
    try:
        while not _finished(manager.current_step(), args.steps, events.with_name("stop")):
            step = manager.current_step() + 1
            if args.kill_step == step:
                append_event(events, event="kill", replica=args.replica, step=step)
                os.kill(os.getpid(), signal.SIGKILL)
            wrapped.zero_grad(set_to_none=True)  # starts the quorum
            before = manager.current_step()
            # train_step's own zero_grad and optimizer.step go to the wrapped optimizer's parts:
            # it steps `wrapped`, which commits only if every participant agrees.
            train_step(model, stage, _NoZero(wrapped), data, step=step, rank=args.replica, world=args.replicas,
                       global_batch=args.global_batch, microbatch=args.microbatch, no_sync=model.no_sync)
            if manager.current_step() > before:
                append_event(events, event="commit", replica=args.replica, step=manager.current_step())
    finally:
        manager.shutdown(wait=False)


def _finished(current: int, steps: int, stop: Path) -> bool:
    """Done once `steps` are committed and the driver's stop step (in `stop`) is reached."""
    return current >= steps and stop.exists() and current >= int(stop.read_text())


class _NoZero:
    """The wrapped optimizer seen by train_step: zero_grad is a no-op (the quorum already
    started and cleared the gradients); step and param_groups go to torchft's wrapper."""

    def __init__(self, wrapped: Any) -> None:
        self._wrapped = wrapped

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def step(self) -> None:
        self._wrapped.step()

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return list(self._wrapped.param_groups)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--replica", type=int, required=True)
    parser.add_argument("--replicas", type=int, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--global-batch", type=int, required=True)
    parser.add_argument("--microbatch", type=int, required=True)
    parser.add_argument("--events", required=True)
    parser.add_argument("--attempt", type=int, default=0)
    parser.add_argument("--kill-step", type=int, default=None)
    worker(parser.parse_args())


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
