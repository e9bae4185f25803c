"""Effective training time under a failure trace: this runtime vs torchrun restart + checkpoint.

    .venv/bin/python bench/effective_time.py --model small --steps 36 --kills 6 16 26 --rejoin-after 5 --repeats 3

The trace: node 2 is SIGKILLed while step k is in flight for each k in --kills, and comes back
--rejoin-after steps later. The rejoining node needs a fresh agent, worker and torch import
(5-25 s here), so the steps between a rejoin and the next kill must cover that: with `tiny`
(~0.15 s a step) they do not, and later kills find the node absent and do not fire (the report
notes it); `small` (~4 s a step) is the default. Kill steps are spaced by a period of P steps of failure-free
progress, i.e. a node lost every T = P x (failure-free step time) seconds; the report gives
the T each side saw. The same step-indexed trace is played on both sides:

- this runtime (4 nodes, 2 pipelines x 2 stages, f = 1): `kill:node=2,step=k` and
  `rejoin:node=2,step=k+R` (a fresh agent for the node: the next reconfiguration takes it in);
- torchrun restart (4 DDP ranks, checkpoint every 10 steps): rank 2 is SIGKILLed when it starts
  step k; torchrun restarts the whole group, which reloads the latest checkpoint (on one host
  the "rejoin" is part of that restart).

Effective fraction = failure-free throughput kept = (steps - 1) / (last commit - first commit)
with failures, over the same quantity of the same side's failure-free run in the same round
(start-up excluded on both sides; restarts after a kill are counted). Rounds alternate sides.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.baselines.ddp_restart import DdpRestartConfig, run_ddp_restart  # noqa: E402
from bench.section import Section, attempt, series  # noqa: E402
from bench.stats import Figure  # noqa: E402

NODES = 4
KILLED = 2
CHECKPOINT_EVERY = 10
MICROBATCH, MICROBATCHES = 2, 4


def runtime_rate(model: str, steps: int, inject: tuple[str, ...], run_dir: Path) -> tuple[float, list[float]]:
    """Committed steps per second after the first commit, and the kill wall times."""
    from bench.recovery import run

    summary = run(model, NODES, steps, inject, run_dir, microbatch=MICROBATCH, microbatches=MICROBATCHES)
    times = summary.step_committed_at
    if summary.steps_committed != steps or len(times) != steps:
        raise RuntimeError(f"runtime run committed {summary.steps_committed} of {steps} steps")
    kills = sorted(
        r["fault_at"] for r in summary.recoveries if r.get("lost_nodes") and not r.get("interrupted")
    )
    return (steps - 1) / (times[-1] - times[0]), kills


def torchrun_rate(model: str, steps: int, kills: list[int], run_dir: Path) -> tuple[float, list[float]]:
    result = run_ddp_restart(DdpRestartConfig(
        model=model, procs=NODES, steps=steps, global_batch=MICROBATCH * MICROBATCHES, microbatch=MICROBATCH,
        checkpoint_every=CHECKPOINT_EVERY, kills=tuple((KILLED, k) for k in kills), run_dir=run_dir,
    ))  # fmt: skip
    from bench.baselines.common import read_events

    kill_times = [e["t"] for e in read_events(run_dir / "events.jsonl") if e["event"] == "kill"]
    return (steps - 1) / result.train_s, kill_times


def rate(
    side: str, kills: list[int], run_dir: Path, *, model: str, steps: int, rejoin_after: int
) -> tuple[float, list[float]]:
    """One run of `side` ("runtime" or "torchrun") on the trace `kills` (empty: failure-free)."""
    if side == "runtime":
        inject = tuple(
            i
            for k in kills
            for i in (f"kill:node={KILLED},step={k}", f"rejoin:node={KILLED},step={k + rejoin_after}")
        )
        return runtime_rate(model, steps, inject, run_dir)
    return torchrun_rate(model, steps, kills, run_dir)


def measure(
    *, model: str, steps: int, kills: list[int], rejoin_after: int, repeats: int, root: Path
) -> Section:
    if any(k + rejoin_after > steps for k in kills):
        raise ValueError(f"every kill step + rejoin-after ({rejoin_after}) must be <= steps ({steps})")
    section = Section(
        title="Effective training time under a failure trace (fraction of failure-free throughput)"
    )
    period = kills[1] - kills[0] if len(kills) > 1 else None
    section.notes.append(
        f"{model}, {NODES} processes, global batch {MICROBATCH * MICROBATCHES}, {steps} steps; node {KILLED} "
        f"killed at steps {kills}" + (f" (every {period} steps)" if period else "")
        + f", back {rejoin_after} steps later; torchrun checkpoints every {CHECKPOINT_EVERY} steps"
    )  # fmt: skip
    started = time.time()
    figures: dict[str, Figure] = {}
    for r in range(repeats):
        base = root / f"round{r}"
        order = ["runtime", "torchrun"] if r % 2 == 0 else ["torchrun", "runtime"]
        kept: dict[str, float] = {}
        for side in order:
            free_run = attempt(f"{side} failure-free round {r}", partial(
                rate, side, [], base / f"{side}-free", model=model, steps=steps, rejoin_after=rejoin_after), section)  # fmt: skip
            trace_run = attempt(f"{side} trace round {r}", partial(
                rate, side, kills, base / f"{side}-trace", model=model, steps=steps, rejoin_after=rejoin_after), section)  # fmt: skip
            if free_run is None or trace_run is None:
                continue
            (free, _), (hit, at) = free_run, trace_run
            kept[side] = hit / free
            gaps = [b - a for a, b in zip(at, at[1:], strict=False)]
            if len(at) < len(kills):
                # An injection fires only while its node is a member: a node that has not rejoined
                # by the next kill step is not killed again, so the trace was played in part.
                section.notes.append(f"{side} round {r}: only {len(at)} of {len(kills)} kills fired "
                                     f"(node {KILLED} not back by the next kill step)")  # fmt: skip
            section.raw.append({"round": r, "side": side, "steps_per_s_free": free, "steps_per_s_trace": hit,
                                "kept": kept[side], "kill_intervals_s": gaps})  # fmt: skip
            print(f"  effective round {r} {side}: kept {kept[side]:.3f} (free {free:.2f} steps/s, "
                  f"trace {hit:.2f} steps/s, kill intervals {[round(g, 1) for g in gaps]} s)", file=sys.stderr, flush=True)  # fmt: skip
            series(figures, f"{model} {side}: throughput kept",
                   "%", 100 * kept[side])  # fmt: skip
            if gaps:
                series(figures, f"{model} {side}: seconds between kills (T)", "s", sum(gaps) / len(gaps))
        if len(kept) < 2:
            continue
        series(figures, f"{model} ratio kept, runtime / torchrun", "x", kept["runtime"] / kept["torchrun"])
    section.figures = list(figures.values())
    section.wall_s = time.time() - started
    return section


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=36)
    parser.add_argument(
        "--kills", type=int, nargs="+", default=[6, 16, 26], help="steps in flight at each kill"
    )
    parser.add_argument("--rejoin-after", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--run-dir", type=Path, default=None)
    args = parser.parse_args()
    root = args.run_dir or Path(tempfile.mkdtemp(prefix="bench-effective-"))
    section = measure(model=args.model, steps=args.steps, kills=args.kills, rejoin_after=args.rejoin_after,
                      repeats=args.repeats, root=root)  # fmt: skip
    print("\n".join(section.lines()))
    if args.json:
        args.json.write_text(json.dumps(section.to_dict(), indent=1))


if __name__ == "__main__":
    main()
