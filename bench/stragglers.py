"""A half-speed node under each straggler policy: steps/s while it is slow and after, against the
failure-free rate of the same job (issue 33).

    .venv/bin/python bench/stragglers.py --nodes 4 --global-batch 32 --device-memory-gib 0.03 --repeats 3
    .venv/bin/python bench/stragglers.py --nodes 4 --global-batch 32 --device-memory-gib 0.03 --node-cpus 0.4 --sides off,rebalance,auto --repeats 3
    .venv/bin/python bench/stragglers.py --nodes 2 --global-batch 16 --repeats 3
    .venv/bin/python bench/stragglers.py --model small --nodes 4 --global-batch 32 --device-memory-gib 1 --steps 210 --repeats 1 --run-timeout 5400  # 2x2, 16.6 s a step here
    .venv/bin/python bench/stragglers.py ... --sides auto --free-from RUN_DIR  # a finished failure-free run as the reference

Each run is `elastic run` (its own etcd, f = 1) for `--steps` steps. In every side but `free`,
`elastic inject slow --factor F --steps N --at-step A` throttles the last node with real
SIGSTOP/SIGCONT while steps A to A+N-1 are in flight (default: 150 steps from step 20, as issue
33 asks); side `auto` runs `--straggler-policy auto` with one hot spare (`--spares 1`), so
the leader can put the spare in the slow node's stage. Figures, from the run's summary (each step's commit time) and events:

- `window`: steps/s over the throttled steps, over the failure-free rate (the `free` run's
  steps/s over the same steps);
- `first 20`: steps/s over the first 20 steps committed after the release, over the same;
- `after 20`: steps/s over the next 20 steps (21-40 after the release), over the same: whether the
  rate is back within 20 steps of the release (issue 33's bar, >= 0.95x).

The throttle is `elastic inject slow`'s default (`--hold-cpu`, elastic/records/throttle.py
`Throttle`): each CPU second the node's workers (their main threads) use becomes F-1 seconds
stopped, taken while they compute, and a burner spins in their place while they are stopped, so
the node computes F times slower and the other simulated nodes on this machine's cores do not run
faster for it.
`--no-hold-cpu` measures with the older duty cycle.

`--node-cpus X` runs `elastic run --node-cpus X`: each node (its workers and their burners) in a
cgroup capped at X cores (elastic/roles/cpu_quota.py, needs root; the agents, etcd and the
launcher stay outside, so leave them some cores: 0.4 a node for 4 nodes on 2). Without it, simulated nodes
share this machine's cores: a node that waits lends its core to the others, so a slow node costs
the job less than it would on separate devices (on 4 nodes and 2 cores, `off` cannot drop below
about 0.75x: the slow node's extra work is a fifth of the machine's).

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
    if args.node_cpus is not None:
        cmd += ["--node-cpus", str(args.node_cpus)]
    job = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        if side != "free":
            deadline = time.monotonic() + 60
            while True:  # until the job's etcd is up and the node has joined
                asked = subprocess.run(
                    [*ELASTIC, "inject", "slow", "--node", str(args.nodes - 1), "--factor", str(args.factor),
                     "--steps", str(args.slow_steps), "--at-step", str(args.slow_at), "--run-dir", str(run_dir),
                     "--wait", "0", "--hold-cpu" if args.hold_cpu else "--no-hold-cpu"], cwd=REPO, capture_output=True, text=True, timeout=60)
                if asked.returncode == 0:
                    break
                if time.monotonic() > deadline:
                    raise SystemExit(f"{side}: inject slow failed: {asked.stdout}{asked.stderr}")
                time.sleep(0.5)
        out, _ = job.communicate(timeout=args.run_timeout)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    if job.returncode != 0:
        raise SystemExit(f"{side}: elastic run exited {job.returncode}:\n{out[-2000:]}")
    lines = subprocess.run([*ELASTIC, "events", "--run-dir", str(run_dir), "--json"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.splitlines() if side != "free" else []
    events = [json.loads(line) for line in lines if line.strip()]
    slow = [e for e in events if e.get("kind") == "injection"]
    return {**read_run(run_dir, side), "slow_at": slow[0]["time"] if slow else None,
            "generations": [line for line in out.splitlines() if "generation" in line
                            and ("rebalance" in line or "spare" in line or "drained" in line)]}


def read_run(run_dir: Path, side: str = "free") -> dict[str, object]:
    """A finished run's commit times and final loss, from its summary; as is, a failure-free
    run's whole record (`--free-from`)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"side": side, "times": summary["step_committed_at"], "loss": summary["losses"][-1], "slow_at": None,
            "generations": []}


def figures(run: dict[str, object], free: dict[str, object], slow_at: int, slow_steps: int) -> tuple[float, ...] | None:
    """(window, first 20, after 20): the run's steps/s over the failure-free run's (module doc).
    `times[i]` is the commit of step i + 1: step k is in flight from times[k - 2] to times[k - 1]."""
    times, free_times = run["times"], free["times"]
    assert isinstance(times, list) and isinstance(free_times, list)
    released = slow_at + slow_steps - 2  # the index of the last throttled step's commit
    if run["slow_at"] is None or len(times) < released + 41:
        return None
    out = []
    for first, last in ((slow_at - 2, released), (released, released + 20), (released + 20, released + 40)):
        rate = (last - first) / (times[last] - times[first])
        base = (last - first) / (free_times[last] - free_times[first])
        out.append(rate / base)
    return tuple(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="model preset (tiny, small, ...)")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--device-memory-gib", type=float, default=None)
    parser.add_argument("--steps", type=int, default=230)
    parser.add_argument("--slow-at", type=int, default=20)
    parser.add_argument("--slow-steps", type=int, default=150)
    parser.add_argument("--factor", type=float, default=2.0)
    parser.add_argument("--sides", default="off,report,rebalance")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hold-cpu", action=argparse.BooleanOptionalAction, default=True,
                        help="the throttle's burner holds the node's share of the cores (module doc)")
    parser.add_argument("--node-cpus", type=float, default=None,
                        help="elastic run --node-cpus: each node capped at this many cores (module doc)")
    parser.add_argument("--run-timeout", type=float, default=600,
                        help="seconds one elastic run may take (small on 4 nodes: 17 s a step here, 210 steps)")
    parser.add_argument("--free-from", type=Path, default=None,
                        help="the run dir of a finished failure-free run of the same job (`elastic run` with the "
                             "same flags, --straggler-policy report --checkpoint-every 0 --run-dir DIR), used as every "
                             "repeat's reference instead of a new one: a long model's sides can go in turns")
    parser.add_argument("--json", type=Path, default=None,
                        help="every run so far, rewritten after each run (a long bench keeps what it measured)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-stragglers-"))
    rows: dict[str, list[tuple[float, ...]]] = {}
    raw = []
    for r in range(args.repeats):
        free = read_run(args.free_from) if args.free_from is not None else run_side(args, "free", root / "free")
        raw.append({k: v for k, v in free.items() if k != "times"})
        for side in args.sides.split(","):
            run = run_side(args, side, root / side)
            got = figures(run, free, args.slow_at, args.slow_steps)
            raw.append({**{k: v for k, v in run.items() if k != "times"}, "figures": got})
            print(f"repeat {r + 1} {side}: {got}, final loss {run['loss']:.6f} (free {free['loss']:.6f}) "
                  f"{run['generations']}", flush=True)
            if got is not None:
                rows.setdefault(side, []).append(got)
            if args.json is not None:
                args.json.write_text(json.dumps({"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                                             "runs": raw}, indent=1))
    cap = f", each node capped at {args.node_cpus:g} cores" if args.node_cpus is not None else ""
    print(f"\n{args.model}, {args.nodes} nodes{cap}, global batch {args.global_batch}, node {args.nodes - 1} at 1/{args.factor:g} "
          f"speed for {args.slow_steps} steps from step {args.slow_at}; median of {args.repeats}")
    print("| policy | steps/s while slow / failure-free | first 20 steps after the release | steps 21-40 after |")
    print("| --- | --- | --- | --- |")
    for side, vals in rows.items():
        cells = " | ".join(f"{statistics.median(v[i] for v in vals):.2f}x ({', '.join(f'{v[i]:.2f}' for v in vals)})"
                           for i in range(3))
        print(f"| {side} | {cells} |")
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
