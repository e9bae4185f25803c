"""Effective training time under a wall-clock failure trace: this runtime vs torchrun restart.

    .venv/bin/python bench/effective_time.py --model small --every 50 --rejoin-after 15 --window 200 --repeats 3

The trace: a node is lost every T seconds (--every) of training, starting T seconds after the
first committed step, and comes back R seconds (--rejoin-after) after its loss; training is
measured for a window of W seconds (--window) from the first commit, so start-up is excluded
on both sides. The same trace is played on both sides, each with 4 worker processes, the same
model, global batch and microbatch:

- this runtime (4 nodes, f = 1, the planner's plans): at each loss time the driver asks,
  through the job's etcd (as `elastic inject kill` does), the agent of a node taking part in
  the current generation (node 2 if it does, else 3, then 1) to SIGKILL its workers; R seconds
  later it asks the launcher for a fresh incarnation of that node (a rejoin request), which the
  next reconfiguration takes in;
- this runtime with one spare (side "runtime+spare", `elastic run --spares 1`): the same 4
  nodes and the same trace, plus a fifth node up as a hot spare: each loss's re-plan takes the
  spare in (the job stays at 4 nodes, its plan unchanged), and the returning node becomes the
  next spare;
- torchrun restart (4 DDP ranks, a checkpoint every 10 steps): at each loss time rank 2 of the
  current attempt is SIGKILLed; torchrun restarts the whole group, which reloads the latest
  checkpoint. Its node count stays fixed (4 ranks), as a real torchrun job without elastic
  min/max would, so the restarted group forms only when the lost node is back, R seconds after
  the loss as on the runtime's side: the restarted rank 2 joins the rendezvous only then (the
  others wait for it in the rendezvous, as they would for a node that is not there yet);
- torchrun restart, node back at once (side "torchrun-at-once"): the same, but the lost node is
  back with the restart (the rejoin delay does not apply), which favours torchrun: a job that
  has a replacement machine standing by.

The planner's derived profile gets PIPELINE_MEMORY_GIB per node (small: 0.5, tiny: 0.023): too
little to hold the model, so every plan is made of multi-stage pipelines (4 nodes: 2 x 2; 3
nodes: one 3-stage pipeline, f relaxed to 0), the regime pipeline templates are for. With the
nominal 80 GiB the planner turns 4 nodes into 4 one-stage pipelines (pure data parallelism) at
the first re-plan, a different, slower-here layout, which would confound the comparison.

A loss falls due while a node may still be on its way back (the runtime) or the group is still
restarting (torchrun); it is then carried out as soon as a victim exists, and the delay is
reported. Progress is the step of the model state at the end of the window: the last step
committed by then (for torchrun, steps redone after a reload count once). Effective fraction =
progress with the trace / progress of the same side's failure-free run of the same window in
the same round. Rounds alternate the order of the sides.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.section import Section, attempt, exit_on_sigterm, series  # noqa: E402
from bench.stats import Figure  # noqa: E402

NODES = 4
VICTIMS = (2, 3, 1)
"""Nodes (runtime) the trace kills, in order of preference; node 0 holds the leader at start."""
KILLED_RANK = 2
"""torchrun: the rank killed."""
CHECKPOINT_EVERY = 10
MICROBATCH, MICROBATCHES = 2, 4
STEPS_CAP = 100_000
"""Steps each run is configured for: far more than a window holds (it is stopped at its end)."""
POLL_S = 0.05


@dataclass(frozen=True, kw_only=True)
class Trace:
    """A node lost every `every_s` seconds of training, back `rejoin_s` seconds later."""

    every_s: float
    """T: seconds between losses (the first at T after the first commit)."""
    rejoin_s: float
    """R: seconds from a loss to the node's return."""

    def loss_times(self, window_s: float) -> list[float]:
        """Loss times (seconds after the first commit) inside a window of `window_s` seconds."""
        out, t = [], self.every_s
        while t < window_s:
            out.append(t)
            t += self.every_s
        return out


@dataclass(kw_only=True)
class TraceRun:
    """What one window of one side produced."""

    progress: int = 0
    """Step of the model state at the end of the window (last step committed by then)."""
    losses: list[float] = field(default_factory=list)
    """Seconds after the first commit at which a node was killed."""
    delays: list[float] = field(default_factory=list)
    """How late each loss was carried out (no victim existed when it fell due)."""
    rejoins: list[float] = field(default_factory=list)
    """Seconds after the first commit at which a node was asked back (runtime only)."""


def _wait(cond: Callable[[], bool], timeout_s: float, what: str, check: Callable[[], None]) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout_s:.0f} s")
        time.sleep(POLL_S)


def _play(
    trace: Trace | None,
    window_s: float,
    *,
    committed: Callable[[], int],
    kill: Callable[[], bool],
    rejoin: Callable[[], None] | None,
    check: Callable[[], None],
) -> TraceRun:
    """Drive one window: wait for the first commit, carry out the trace, return the progress.
    `kill()` kills a victim and says whether one existed; `rejoin()` brings the oldest loss back."""
    _wait(lambda: committed() >= 1, 600.0, "no step committed", check)
    t0 = time.time()
    out = TraceRun()
    due = trace.loss_times(window_s) if trace else []
    comebacks: list[float] = []
    while (now := time.time()) < t0 + window_s:
        check()
        if due and now >= t0 + due[0] and kill():
            out.losses.append(now - t0)
            out.delays.append(now - t0 - due.pop(0))
            if trace is not None and rejoin is not None:
                comebacks.append(now + trace.rejoin_s)
        if comebacks and now >= comebacks[0] and rejoin is not None:
            comebacks.pop(0)
            rejoin()
            out.rejoins.append(now - t0)
        time.sleep(POLL_S)
    out.progress = committed()
    return out


PIPELINE_MEMORY_GIB = {"tiny": 0.023, "small": 0.5}
"""Per-node memory of the planner's derived profile that keeps every pipeline multi-stage."""


def runtime_window(model: str, trace: Trace | None, window_s: float, run_dir: Path, *, spares: int = 0,
                   memory_gib: float | None = None) -> TraceRun:
    """One window of this runtime (a launch_elastic run in a thread, stopped at the window's end),
    with `spares` hot spare nodes beside the 4; `memory_gib`: per-node memory of the planner's
    profile (default PIPELINE_MEMORY_GIB of the model)."""
    from bench.recovery import run
    from elastic.coordinator.keys import RunKeys
    from elastic.ops.job_target import find_job, open_client, resolve_target
    from elastic.records.generation import GenerationRecord
    from elastic.records.injection_requests import InjectionRequest, request_id, submit_request
    from elastic.records.progress import committed_steps
    from elastic.records.workers import live_nodes
    from elastic.roles.launch_errors import JobFailed

    stop = threading.Event()
    failed: list[BaseException] = []

    def job() -> None:
        try:
            run(model, NODES, STEPS_CAP, (), run_dir, microbatch=MICROBATCH, microbatches=MICROBATCHES, stop=stop,
                device_memory_gib=memory_gib if memory_gib is not None else PIPELINE_MEMORY_GIB.get(model),
                spares=spares)
        except JobFailed as exc:
            if not stop.is_set():
                failed.append(exc)
        except BaseException as exc:  # reported by check() in the driving thread
            failed.append(exc)

    def check() -> None:
        if failed:
            raise RuntimeError(f"runtime run failed: {failed[0]}")
        if not thread.is_alive() and not stop.is_set():
            raise RuntimeError("runtime run ended before the window did")

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "job.json").unlink(missing_ok=True)  # a retried window must not follow the failed try's etcd
    thread = threading.Thread(target=job, name="runtime-window", daemon=True)
    thread.start()
    client = None
    try:
        _wait(lambda: (run_dir / "job.json").exists(), 120.0, "no job.json", check)
        target = resolve_target(etcd=None, job=None, run_dir=str(run_dir))
        client = open_client(target)
        keys = find_job(client, target)
        rk = RunKeys(keys)
        lost: list[int] = []

        def committed() -> int:
            return committed_steps(client, rk)

        def kill() -> bool:
            from elastic.coordinator.generations import Generations

            gen = Generations(client, keys).current()
            taking_part = GenerationRecord.from_json(gen.plan).incarnations if gen is not None else {}
            members = live_nodes(client, keys)
            victim = next((n for n in VICTIMS if n in members and taking_part.get(n) == members[n]), None)
            if victim is None:
                return False
            submit_request(client, keys.root, InjectionRequest(
                id=request_id("kill", victim, None), kind="kill", node=victim, incarnation=members[victim],
                requested_at=time.time(), by="bench"))
            lost.append(victim)
            return True

        def rejoin() -> None:
            node = lost.pop(0)
            submit_request(client, keys.root, InjectionRequest(
                id=request_id("rejoin", node, None), kind="rejoin", node=node, incarnation=None,
                requested_at=time.time(), by="bench"))

        return _play(trace, window_s, committed=committed, kill=kill, rejoin=rejoin, check=check)
    finally:
        stop.set()
        if client is not None:
            client.close()
        thread.join(timeout=120.0)


def torchrun_window(model: str, trace: Trace | None, window_s: float, run_dir: Path, *,
                    back_at_once: bool = False) -> TraceRun:
    """One window of torchrun restart + DDP (stopped at the window's end). The killed rank's
    node is back `trace.rejoin_s` after the loss, as on the runtime's side: the restarted group
    (its node count fixed) forms only then. `back_at_once`: the node is back with the restart."""
    from bench.baselines.common import read_events
    from bench.baselines.ddp_restart import DdpRestartConfig, start_ddp_restart, stop_ddp_restart

    config = DdpRestartConfig(
        model=model, procs=NODES, steps=STEPS_CAP, global_batch=MICROBATCH * MICROBATCHES, microbatch=MICROBATCH,
        checkpoint_every=CHECKPOINT_EVERY, run_dir=run_dir,
    )
    events_path = run_dir / "events.jsonl"
    proc = start_ddp_restart(config, max_restarts=1000)

    def check() -> None:
        if proc.poll() is not None:
            raise RuntimeError(f"torchrun exited with {proc.returncode}; see {run_dir / 'torchrun.log'}")

    def committed() -> int:
        commits = [e for e in read_events(events_path) if e["event"] == "commit"]
        return int(commits[-1]["step"]) if commits else 0

    def kill() -> bool:
        events = read_events(events_path)
        attempts = [e for e in events if e["event"] == "start"]
        latest = max((e["attempt"] for e in attempts), default=-1)
        killed = {e["attempt"] for e in events if e["event"] == "kill"}
        victim = next((e for e in attempts if e["attempt"] == latest and e["rank"] == KILLED_RANK), None)
        trained = any(e["event"] == "loaded" and e["attempt"] == latest for e in events)
        if victim is None or latest in killed or not trained:
            return False  # the group is (re)starting: the loss waits for a running victim
        from bench.baselines.common import append_event

        back = {} if back_at_once or trace is None else {"back_at": time.time() + trace.rejoin_s}
        append_event(events_path, event="kill", attempt=latest, rank=KILLED_RANK, step=committed() + 1, **back)
        try:
            os.kill(int(victim["pid"]), signal.SIGKILL)
        except ProcessLookupError:
            return False
        return True

    try:
        return _play(trace, window_s, committed=committed, kill=kill, rejoin=None, check=check)
    finally:
        stop_ddp_restart(proc, run_dir)


WINDOWS: dict[str, Callable[[str, Trace | None, float, Path], TraceRun]] = {
    "runtime": runtime_window,
    "torchrun": torchrun_window,
    "runtime+spare": partial(runtime_window, spares=1),
    "torchrun-at-once": partial(torchrun_window, back_at_once=True),
}
DEFAULT_SIDES = ("runtime", "torchrun", "runtime+spare")
"""The sides run unless --sides names others (torchrun-at-once on request)."""


def measure(*, model: str, trace: Trace, window_s: float, repeats: int, root: Path,
            sides: tuple[str, ...] = DEFAULT_SIDES, memory_gib: float | None = None) -> Section:
    """`memory_gib`: per-node memory of the runtime sides' planner profile (default: the model's
    PIPELINE_MEMORY_GIB, which keeps every pipeline multi-stage; 80, a GPU's, lets the planner
    choose pure data parallelism for a model that fits, as torchrun's DDP side runs)."""
    unknown = [s for s in sides if s not in WINDOWS]
    if unknown or not sides:
        raise ValueError(f"unknown sides {unknown}; choose from {', '.join(WINDOWS)}")
    if trace.every_s <= 0 or trace.rejoin_s <= 0 or window_s <= trace.every_s:
        raise ValueError(f"need every > 0, rejoin-after > 0 and window > every; got {trace}, window {window_s}")
    section = Section(
        title="Effective training time under a failure trace (fraction of failure-free progress)"
    )
    memory = memory_gib if memory_gib is not None else PIPELINE_MEMORY_GIB.get(model)
    section.notes.append(
        f"runtime plans: the planner's, with {memory:g} GiB per node" if memory
        else "runtime plans: first an even split into 2 pipelines, then the planner's (nominal 80 GiB per node)"
    )
    windows = {side: WINDOWS[side] if side.startswith("torchrun") else partial(WINDOWS[side], memory_gib=memory_gib)
               for side in sides}
    section.notes.append(
        f"{model}, {NODES} processes, global batch {MICROBATCH * MICROBATCHES}; a node lost every {trace.every_s:g} s, "
        f"back {trace.rejoin_s:g} s later (torchrun's restarted group forms only then; torchrun-at-once: back with its "
        f"restart); {window_s:g} s of training from the "
        f"first commit ({len(trace.loss_times(window_s))} losses); torchrun checkpoints every {CHECKPOINT_EVERY} steps"
    )
    started = time.time()
    figures: dict[str, Figure] = {}
    for r in range(repeats):
        base = root / f"round{r}"
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        kept: dict[str, float] = {}
        steps: dict[str, int] = {}
        for side in order:
            window = windows[side]
            free = attempt(f"{side} failure-free round {r}", partial(window, model, None, window_s, base / f"{side}-free"),
                           section)
            hit = attempt(f"{side} trace round {r}", partial(window, model, trace, window_s, base / f"{side}-trace"),
                          section)
            if free is None or hit is None or free.progress == 0:
                continue
            kept[side] = hit.progress / free.progress
            steps[side] = hit.progress
            row: dict[str, Any] = {"round": r, "side": side, "progress_free": free.progress,
                                   "progress_trace": hit.progress, "kept": kept[side], "losses_s": hit.losses,
                                   "loss_delays_s": hit.delays, "rejoins_s": hit.rejoins}
            section.raw.append(row)
            print(f"  effective round {r} {side}: {json.dumps(row)}", file=sys.stderr, flush=True)
            series(figures, f"{model} {side}: progress kept", "%", 100 * kept[side])
            series(figures, f"{model} {side}: steps in {window_s:g} s, failure-free", "steps", free.progress)
            series(figures, f"{model} {side}: steps in {window_s:g} s, with the trace", "steps", hit.progress)
            if hit.delays:
                series(figures, f"{model} {side}: loss carried out late by (max)", "s", max(hit.delays))
        _ratios(figures, model, kept, steps)
    section.figures = list(figures.values())
    section.wall_s = time.time() - started
    return section


def _ratios(figures: dict[str, Figure], model: str, kept: dict[str, float], steps: dict[str, int]) -> None:
    """One round's ratios of each runtime side to torchrun: progress kept, and steps committed
    with the trace in the window."""
    for side in ("runtime", "runtime+spare"):
        if side in kept and "torchrun" in kept:
            series(figures, f"{model} ratio kept, {side} / torchrun", "x", kept[side] / kept["torchrun"])
            if steps["torchrun"]:
                series(figures, f"{model} ratio steps with the trace, {side} / torchrun", "x",
                       steps[side] / steps["torchrun"])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="small")
    parser.add_argument("--every", type=float, default=50.0, help="T: seconds between node losses")
    parser.add_argument("--rejoin-after", type=float, default=15.0, help="R: seconds from a loss to the return")
    parser.add_argument("--window", type=float, default=200.0, help="W: seconds of training measured")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--run-dir", type=Path, default=None)
    parser.add_argument("--node-memory-gib", type=float, default=None,
                        help="per-node memory of the runtime's planner profile (default: the model's "
                             f"{PIPELINE_MEMORY_GIB}, multi-stage pipelines only; 80: the planner may choose "
                             "pure data parallelism, as torchrun's DDP)")
    parser.add_argument("--sides", default=",".join(DEFAULT_SIDES),
                        help=f"comma-separated subset of {', '.join(WINDOWS)} (default: {', '.join(DEFAULT_SIDES)})")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    exit_on_sigterm()
    root = args.run_dir or Path(tempfile.mkdtemp(prefix="bench-effective-"))
    print(f"runs under {root}", file=sys.stderr, flush=True)
    trace = Trace(every_s=args.every, rejoin_s=args.rejoin_after)
    try:
        section = measure(model=args.model, trace=trace, window_s=args.window, repeats=args.repeats, root=root,
                          sides=tuple(s.strip() for s in args.sides.split(",") if s.strip()),
                          memory_gib=args.node_memory_gib)
    except ValueError as exc:
        parser.error(str(exc))
    print("\n".join(section.lines()))
    if args.json:
        args.json.write_text(json.dumps(section.to_dict(), indent=1))


if __name__ == "__main__":
    main()
