"""A half-speed node under each straggler policy: steps/s while it is slow and after, against the
failure-free rate of the same job (issue 33).

    .venv/bin/python bench/stragglers.py --nodes 2 --global-batch 16 --repeats 3
    .venv/bin/python bench/stragglers.py --nodes 4 --global-batch 32 --device-memory-gib 0.03 --repeats 3
    .venv/bin/python bench/stragglers.py --model small --nodes 4 --global-batch 32 --device-memory-gib 1 --repeats 3  # 2x2, 6.4 s a step here

Each run is `elastic run` (its own etcd, f = 1) for `--steps` steps. In every side but `free`,
`elastic inject slow --factor F --seconds S --at-step A` throttles the last node with real
SIGSTOP/SIGCONT; side `auto` runs `--straggler-policy auto` with one hot spare (`--spares 1`), so
the leader can put the spare in the slow node's stage. Figures, from the run's summary (each step's commit time) and events:

- `window`: steps/s from the throttle's start to its end, over the failure-free rate (the `free`
  run's steps/s over the same steps);
- `after`: steps/s over the 20 steps committed from 1 s after the release, over the same.

The same side runs `--repeats` times and the median is reported; every run's final loss is
printed (a policy changes the plan, never the result). Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ELASTIC = [sys.executable, "-m", "elastic.cli"]


def _rate(times: list[float], start: float, end: float) -> float | None:
    inside = [t for t in times if start <= t <= end]
    return (len(inside) - 1) / (inside[-1] - inside[0]) if len(inside) > 2 else None


def run_side(args: argparse.Namespace, side: str, run_dir: Path) -> dict[str, object]:
    """One run of `side` (free, off, report, rebalance, auto: with one hot spare); its commit times,
    throttle and loss."""
    shutil.rmtree(run_dir, ignore_errors=True)
    policy = "report" if side == "free" else side
    cmd = [*ELASTIC, "run", "--model", args.model, "--nodes", str(args.nodes), "--fault-tolerance", "1", "--global-batch",
           str(args.global_batch), "--steps", str(args.steps), "--run-dir", str(run_dir), "--straggler-policy", policy,
           "--checkpoint-every", "0", *(["--spares", "1"] if side == "auto" else [])]
    if args.device_memory_gib is not None:
        cmd += ["--device-memory-gib", str(args.device_memory_gib)]
    job = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        if side != "free":
            deadline = time.monotonic() + 60
            while True:  # until the job's etcd is up and the node has joined
                asked = subprocess.run(
                    [*ELASTIC, "inject", "slow", "--node", str(args.nodes - 1), "--factor", str(args.factor),
                     "--seconds", str(args.slow_s), "--at-step", str(args.slow_at), "--run-dir", str(run_dir),
                     "--wait", "0"], cwd=REPO, capture_output=True, text=True, timeout=60)
                if asked.returncode == 0:
                    break
                if time.monotonic() > deadline:
                    raise SystemExit(f"{side}: inject slow failed: {asked.stdout}{asked.stderr}")
                time.sleep(0.5)
        out, _ = job.communicate(timeout=600)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    if job.returncode != 0:
        raise SystemExit(f"{side}: elastic run exited {job.returncode}:\n{out[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    lines = subprocess.run([*ELASTIC, "events", "--run-dir", str(run_dir), "--json"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.splitlines() if side != "free" else []
    events = [json.loads(line) for line in lines if line.strip()]
    slow = [e for e in events if e.get("kind") == "injection"]
    return {"side": side, "times": summary["step_committed_at"], "loss": summary["losses"][-1],
            "slow_at": slow[0]["time"] if slow else None,
            "generations": [line for line in out.splitlines() if "generation" in line
                            and ("rebalance" in line or "spare" in line or "drained" in line)]}


def figures(run: dict[str, object], free: dict[str, object], slow_s: float) -> tuple[float, float] | None:
    times, free_times, start = run["times"], free["times"], run["slow_at"]
    assert isinstance(times, list) and isinstance(free_times, list)
    if not isinstance(start, float):
        return None
    end = start + slow_s
    in_window = [i for i, t in enumerate(times) if start <= t <= end]
    after = [i for i, t in enumerate(times) if t >= end + 1.0][:20]
    if len(in_window) < 3 or len(after) < 3:
        return None
    window_rate = _rate(times, start, end)
    after_rate = (len(after) - 1) / (times[after[-1]] - times[after[0]])
    base_w = _rate(free_times, free_times[in_window[0]], free_times[in_window[-1]])
    base_a = (len(after) - 1) / (free_times[after[-1]] - free_times[after[0]])
    if window_rate is None or base_w is None:
        return None
    return window_rate / base_w, after_rate / base_a


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="model preset (tiny, small, ...)")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--device-memory-gib", type=float, default=None)
    parser.add_argument("--steps", type=int, default=260)
    parser.add_argument("--slow-at", type=int, default=20)
    parser.add_argument("--slow-s", type=float, default=15.0)
    parser.add_argument("--factor", type=float, default=2.0)
    parser.add_argument("--sides", default="off,report,rebalance")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-stragglers-"))
    rows: dict[str, list[tuple[float, float]]] = {}
    raw = []
    for r in range(args.repeats):
        free = run_side(args, "free", root / "free")
        raw.append({k: v for k, v in free.items() if k != "times"})
        for side in args.sides.split(","):
            run = run_side(args, side, root / side)
            got = figures(run, free, args.slow_s)
            raw.append({**{k: v for k, v in run.items() if k != "times"}, "figures": got})
            print(f"repeat {r + 1} {side}: {got}, final loss {run['loss']:.6f} (free {free['loss']:.6f}) "
                  f"{run['generations']}", flush=True)
            if got is not None:
                rows.setdefault(side, []).append(got)
    print(f"\n{args.model}, {args.nodes} nodes, global batch {args.global_batch}, node {args.nodes - 1} at 1/{args.factor:g} speed "
          f"for {args.slow_s:g} s from step {args.slow_at}; median of {args.repeats}")
    print("| policy | steps/s while slow / failure-free | steps/s after the release / failure-free |")
    print("| --- | --- | --- |")
    for side, vals in rows.items():
        print(f"| {side} | {statistics.median(v[0] for v in vals):.2f}x | {statistics.median(v[1] for v in vals):.2f}x |")
    if args.json is not None:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "runs": raw}, indent=1))
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
