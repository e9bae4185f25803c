"""How a long failure-free run's costs grow with its steps: step time and the workers' memory.

    PYTHONPATH=. .venv/bin/python bench/long_run.py --steps 3000 -- --model tiny --nodes 4 \
        --fault-tolerance 1 --global-batch 16 --microbatch 4 --shard-optimizer on --checkpoint-every 5

One `elastic run` with the flags after `--` (and `--steps`, `--run-dir`, `--summary` from here),
as a user starts it. Every `--every` seconds the resident memory (RSS) of each of its worker
processes (bench/process_cpu.py's roles) is read. Figures: the median interval between commits
over the last `--window` steps against that of the `--window` steps after the first `--skip`
(late / early), and each worker's RSS at the end against its first sample after step `--skip`
(the largest growth, in MB and in bytes a step). A cost that grows with the steps (a queue, a
record kept per step, a cache) shows in both; the run's own early steps are the baseline.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.process_cpu import role_of  # noqa: E402


def worker_rss(root: psutil.Process) -> dict[int, int]:
    """PID -> RSS in bytes of every worker process under `root`."""
    out: dict[int, int] = {}
    for proc in root.children(recursive=True):
        try:
            if role_of(proc.cmdline()) == "worker":
                out[proc.pid] = proc.memory_info().rss
        except psutil.Error:
            continue
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--skip", type=int, default=50, help="steps of warm-up before the early window")
    parser.add_argument("--window", type=int, default=250, help="steps in each of the early and late windows")
    parser.add_argument("--every", type=float, default=5.0, help="seconds between memory samples")
    parser.add_argument("--json", type=Path, help="write the figures and samples here")
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="`--` then the flags of `elastic run`")
    args = parser.parse_args()
    flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    if args.steps < args.skip + 2 * args.window:
        parser.error(f"--steps {args.steps} is less than --skip + 2 x --window")
    with tempfile.TemporaryDirectory(prefix="bench-long-") as tmp:
        summary_path = Path(tmp) / "summary.json"
        argv = [sys.executable, "-m", "elastic.cli", "run", *flags, "--steps", str(args.steps),
                "--run-dir", str(Path(tmp) / "run"), "--summary", str(summary_path)]
        samples: list[tuple[float, dict[int, int]]] = []
        with open(Path(tmp) / "out.log", "w") as log:
            proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
            root = psutil.Process(proc.pid)
            while proc.poll() is None:
                rss = worker_rss(root)
                if rss:
                    samples.append((time.time(), rss))
                time.sleep(args.every)
        if proc.returncode != 0:
            raise SystemExit(f"elastic run exited {proc.returncode}:\n{(Path(tmp) / 'out.log').read_text()[-3000:]}")
        summary = json.loads(summary_path.read_text())
    commits = summary["step_committed_at"]
    gaps = [b - a for a, b in zip(commits, commits[1:], strict=False)]
    early = statistics.median(gaps[args.skip:args.skip + args.window])
    late = statistics.median(gaps[-args.window:])
    after = commits[min(args.skip, len(commits) - 1)]
    first_at, first = next((at, rss) for at, rss in samples if at >= after)
    last = samples[-1][1]
    growth = {pid: last[pid] - first[pid] for pid in last if pid in first}
    worst = max(growth.values())
    steps_between = sum(1 for t in commits if t >= first_at)
    print(f"{args.steps} steps, {len(last)} workers: step interval early {early * 1e3:.1f} ms, late "
          f"{late * 1e3:.1f} ms, late / early {late / early:.3f}")
    print(f"worker RSS: {min(first.values()) / 2**20:.0f}-{max(first.values()) / 2**20:.0f} MB after step "
          f"{args.skip}, {min(last.values()) / 2**20:.0f}-{max(last.values()) / 2**20:.0f} MB at the end; the largest "
          f"growth {worst / 2**20:+.1f} MB ({worst / max(steps_between, 1):+.0f} B a step over {steps_between} steps)")
    if args.json:
        args.json.write_text(json.dumps({"flags": flags, "steps": args.steps, "early_s": early, "late_s": late,
                                         "rss_first": first, "rss_last": last, "growth_max": worst,
                                         "samples": samples}, indent=1))


if __name__ == "__main__":
    main()
