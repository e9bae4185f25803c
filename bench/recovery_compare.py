"""Recovery from the SIGKILL of one node: this runtime vs torchrun restart + checkpoint vs torchft.

    .venv/bin/python bench/recovery_compare.py --presets tiny --repeats 3 [--json out.json]

Every side runs the same model, the same 4 worker processes on this machine, the same global
batch and microbatch size, and loses one node (one worker process) to a real SIGKILL while the
same step is in flight:

- this runtime: `launch_elastic`, 4 nodes as 2 pipelines x 2 stages (f = 1), `kill:node=2,step=K`;
  survivors reconfigure in place and replay the in-flight step. Steps lost: 0 unless the
  checkpoint fallback restored an older step.
- torchrun restart (bench/baselines/ddp_restart.py): `torchrun --nnodes=1 --nproc-per-node=4
  --max-restarts=1 --rdzv-backend=c10d`, plain DDP, a checkpoint every 10 steps; rank 2 is
  killed; torchrun restarts the whole worker group, which reloads the latest checkpoint.
  Steps lost: K - 1 - the checkpoint step.
- torchft (bench/baselines/torchft_peer.py): 4 replica groups of one process under a local
  lighthouse; replica 2 is killed, the survivors go on in a smaller quorum, and the restarted
  replica heals from a peer.

Rounds rotate the order of the sides so that load from other jobs hits each alike. Each figure
is the median over rounds with its spread (bench/stats.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.baselines.ddp_restart import DdpRestartConfig, run_ddp_restart  # noqa: E402
from bench.baselines.torchft_peer import TorchftConfig, run_torchft  # noqa: E402
from bench.section import Section, attempt, series  # noqa: E402
from bench.stats import Figure  # noqa: E402

NODES = 4
"""Worker processes on every side (the runtime's 4 nodes, 4 DDP ranks, 4 torchft replicas)."""
KILLED = 2
"""The node (runtime), rank (torchrun) and replica (torchft) that is killed."""
CHECKPOINT_EVERY = 10
"""torchrun baseline: committed steps between checkpoints."""


@dataclass(frozen=True, kw_only=True)
class PresetRun:
    """How one preset is run: steps, kill step and batch (the same on every side)."""

    steps: int
    """Steps of each run."""
    kill_step: int
    """Step in flight when the node is killed."""
    microbatch: int
    """Samples per microbatch."""
    microbatches: int
    """Microbatches per step (global batch = microbatch x microbatches)."""

    @property
    def global_batch(self) -> int:
        return self.microbatch * self.microbatches


FULL = {
    # Killed mid-way between checkpoints (5 committed steps since the last one), the expected
    # loss of a failure at a uniformly random time with a checkpoint every 10 steps.
    "tiny": PresetRun(steps=18, kill_step=16, microbatch=2, microbatches=4),
    "small": PresetRun(steps=18, kill_step=16, microbatch=2, microbatches=4),
    # A CPU step of gpt2-124m takes tens of seconds: a couple of steps, no checkpoint reached.
    "gpt2-124m": PresetRun(steps=4, kill_step=3, microbatch=1, microbatches=4),
}
QUICK = {"tiny": PresetRun(steps=14, kill_step=13, microbatch=2, microbatches=4)}

SIDES = ("runtime", "torchrun", "torchft")


def run_runtime(model: str, preset: PresetRun, run_dir: Path) -> dict[str, float]:
    from bench.recovery import run

    summary = run(model, NODES, preset.steps, (f"kill:node={KILLED},step={preset.kill_step}",), run_dir,
                  microbatch=preset.microbatch, microbatches=preset.microbatches)
    rec = next(r for r in summary.recoveries if not r.get("interrupted"))
    restored = rec.get("restore_checkpoint")
    return {"next_commit_s": rec["total_s"], "regain_s": rec["total_s"],
            "steps_lost": 0 if restored is None else preset.kill_step - 1 - int(restored),
            "steady_step_s": summary.steady_step_s, "bytes_moved": rec["bytes_moved"],
            "replayed_fraction": rec["replayed_fraction"]}


def run_torchrun(model: str, preset: PresetRun, run_dir: Path) -> dict[str, float]:
    result = run_ddp_restart(DdpRestartConfig(
        model=model, procs=NODES, steps=preset.steps, global_batch=preset.global_batch, microbatch=preset.microbatch,
        checkpoint_every=CHECKPOINT_EVERY, kills=((KILLED, preset.kill_step),), run_dir=run_dir,
    ))
    (r,) = result.restarts
    return {"next_commit_s": r.next_commit_s, "regain_s": r.regain_s, "steps_lost": r.steps_lost,
            "restart_s": r.restart_s, "load_s": r.load_s, "steady_step_s": result.steady_step_s}


def run_torchft_side(model: str, preset: PresetRun, run_dir: Path) -> dict[str, float]:
    result = run_torchft(TorchftConfig(
        model=model, replicas=NODES, steps=preset.steps, global_batch=preset.global_batch,
        microbatch=preset.microbatch, kills=((KILLED, preset.kill_step),), run_dir=run_dir,
    ))
    (r,) = result.recoveries
    return {"next_commit_s": r.next_commit_s, "regain_s": r.next_commit_s, "steps_lost": r.steps_lost,
            "rejoin_s": r.rejoin_s, "steady_step_s": result.steady_step_s}


RUNNERS = {"runtime": run_runtime, "torchrun": run_torchrun, "torchft": run_torchft_side}
LABELS = {"runtime": "runtime", "torchrun": "torchrun", "torchft": "torchft"}


def measure(
    *, presets: list[str], repeats: int, quick: bool, root: Path, sides: tuple[str, ...] = SIDES
) -> Section:
    """Run every side `repeats` times per preset, rotating their order each round."""
    table = QUICK if quick else FULL
    section = Section(title="Recovery: SIGKILL of one node -> next committed step")
    started = time.time()
    figures: dict[str, Figure] = {}
    failed: dict[str, list[str]] = {}
    for model in presets:
        preset = table.get(model) or FULL[model]
        section.notes.append(
            f"{model}: {NODES} processes, global batch {preset.global_batch} (microbatch {preset.microbatch}), "
            f"kill at step {preset.kill_step} of {preset.steps}; torchrun checkpoints every {CHECKPOINT_EVERY} steps"
        )
        for r in range(repeats):
            values: dict[str, dict[str, float]] = {}
            for side in sides[r % len(sides) :] + sides[: r % len(sides)]:
                key = f"{model}/{side}"
                if key in failed and side == "torchft":
                    continue  # a peer system that failed here once is not retried every round
                run_dir = root / f"{model}-{side}-{r}"
                got = attempt(
                    f"{model} {side} round {r}", partial(RUNNERS[side], model, preset, run_dir), section
                )
                if got is None:
                    failed.setdefault(key, []).append(section.notes[-1].split("(", 1)[-1].rstrip(")"))
                    continue
                values[side] = got
                section.raw.append({"model": model, "side": side, "round": r, **values[side]})
                print(f"  {model} {side} round {r}: {json.dumps(values[side])}", file=sys.stderr, flush=True)
            for side, v in values.items():
                label = f"{model} {LABELS[side]}"
                series(figures, f"{label}: kill -> next commit", "s", v["next_commit_s"])
                series(figures, f"{label}: steps lost", "steps", v["steps_lost"])
                if side == "runtime" and v.get("replayed_fraction") is not None:
                    series(figures, f"{label}: replayed fraction of step K", "x", v["replayed_fraction"])
                if side == "torchrun":
                    series(figures, f"{label}: kill -> step K again", "s", v["regain_s"])
                if side == "torchft":
                    series(figures, f"{label}: kill -> replaced replica commits", "s", v["rejoin_s"])
            if "runtime" in values:
                for side in ("torchrun", "torchft"):
                    if side in values:
                        series(figures, f"{model} ratio {LABELS[side]} / runtime, next commit", "x",
                               values[side]["next_commit_s"] / values["runtime"]["next_commit_s"])
    section.figures = list(figures.values())
    section.not_run = [
        f"{k.replace('/', ' ')}: not run in {len(why)} round(s): {why[-1]}" for k, why in failed.items()
    ]
    section.wall_s = time.time() - started
    return section


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--presets", nargs="+", default=list(FULL), choices=list(FULL))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="shorter runs (tiny: 14 steps, kill at 13)")
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=list(SIDES))
    parser.add_argument("--json", type=Path, default=None, help="write the section here")
    parser.add_argument("--run-dir", type=Path, default=None, help="keep the runs here (default: a temp dir)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    root = args.run_dir or Path(tempfile.mkdtemp(prefix="bench-recovery-compare-"))
    section = measure(
        presets=args.presets, repeats=args.repeats, quick=args.quick, root=root, sides=tuple(args.sides)
    )
    print("\n".join(section.lines()))
    if args.json:
        args.json.write_text(json.dumps(section.to_dict(), indent=1))


if __name__ == "__main__":
    main()
