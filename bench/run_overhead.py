"""What a short `elastic run` costs besides its steps, against another checkout of the code.

    .venv/bin/python bench/run_overhead.py --baseline DIR [--rounds 6] [--steps 3] [--out FILE]

`DIR` is another checkout (e.g. `git worktree add /tmp/base HEAD~1`): its code runs with
`PYTHONPATH=DIR` from `DIR`, this checkout's with `PYTHONPATH` set to it, alternating in every
round (the order flips each round), the same `elastic run` of `tiny` on 4 nodes, embedded etcd,
no report, as a user runs it. Per run, from the command's own output:

- start: the command's start -> its `step 1/` line (interpreter, planning, etcd, the warm
  parent, agents, workers, rendezvous, the first step);
- steps: `step 1/` -> the last `step N/` line;
- end: the last step line -> the command's exit (agents and workers stopped, etcd stopped, the
  history and summary written);
- whole: the command's start -> its exit.

Medians over the rounds, and this checkout / the baseline. The speed-up of a change to start or
stop is read in `start`, `end` and `whole`; `steps` should not move.
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
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RUN = ["--model", "tiny", "--nodes", "4", "--fault-tolerance", "1", "--global-batch", "8", "--microbatch", "1",
       "--no-report"]
FIGURES = ("start", "steps", "end", "whole")


def one_run(code: Path, run_dir: Path, steps: int) -> dict[str, float]:
    """One `elastic run` of `code`'s checkout; its phases in seconds."""
    env = {**os.environ, "PYTHONPATH": str(code), "PYTHONUNBUFFERED": "1"}
    env.pop("ELASTIC_ZYGOTE", None)
    began = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "elastic.cli", "run", *RUN, "--steps", str(steps),
                             "--run-dir", str(run_dir)], env=env, cwd=code, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    first = last = None
    out = []
    for line in proc.stdout:
        out.append(line)
        if line.startswith("step "):
            last = time.monotonic() - began
            first = last if first is None else first
    ended = time.monotonic() - began
    if proc.wait() != 0 or first is None or last is None:
        raise RuntimeError(f"elastic run of {code} failed:\n{''.join(out[-30:])}")
    return {"start": first, "steps": last - first, "end": ended - last, "whole": ended}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, required=True, help="another checkout of the code")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write every run's figures as JSON here")
    args = parser.parse_args()
    if not (args.baseline / "elastic" / "cli" / "main.py").is_file():
        parser.error(f"--baseline {args.baseline}: not a checkout of this project (no elastic/cli/main.py)")
    sides = {"baseline": args.baseline.resolve(), "this": REPO}
    runs: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory(prefix="run-overhead-") as d:
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for side in order:
                runs[side].append(one_run(sides[side], Path(d) / f"{side}-{r}", args.steps))
                print(f"round {r + 1} {side}: " + ", ".join(f"{k} {v:.2f} s" for k, v in runs[side][-1].items()),
                      flush=True)
    print(f"\n| `elastic run` tiny, 4 nodes, {args.steps} steps, median of {args.rounds} | baseline ({args.baseline}) "
          "| this checkout | this / baseline |")
    print("| --- | --- | --- | --- |")
    for fig in FIGURES:
        base, this = (statistics.median(x[fig] for x in runs[side]) for side in sides)
        print(f"| {fig} | {base:.2f} s | {this:.2f} s | {this / base:.2f}x |")
    if args.out is not None:
        args.out.write_text(json.dumps({"baseline": str(args.baseline), "steps": args.steps, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
