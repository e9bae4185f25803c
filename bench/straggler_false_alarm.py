"""No false alarm: a long failure-free run, with a CPU-heavy process started halfway, should mark
no node as a straggler, or at most one mark that clears by itself (issue 33).

    .venv/bin/python bench/straggler_false_alarm.py --steps 2000 --hogs 1
    .venv/bin/python bench/straggler_false_alarm.py --steps 2000 --hogs 1 --nodes 4 --global-batch 32 \
        --device-memory-gib 0.03

One `elastic run` (its own etcd, f = 1, `--straggler-policy auto`, the default) of `--steps`
steps. Once half of them are committed, `--hogs` busy-loop processes start beside it (each takes
a core when it can) and run to the end. The result lists every `straggler` / `straggler-cleared`
event, the generations (a plan change would show there) and the step rate before and after the
hogs started. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ELASTIC = [sys.executable, "-m", "elastic.cli"]
HOG = "while True: pass"


def _step_of(line: str) -> int | None:
    """N of `elastic run`'s progress line `step N/TOTAL  loss ...`."""
    words = line.split()
    if len(words) < 2 or words[0] != "step" or "/" not in words[1]:
        return None
    try:
        return int(words[1].split("/", 1)[0])
    except ValueError:
        return None


def _rate(times: list[float]) -> float | None:
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 2 and times[-1] > times[0] else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--hogs", type=int, default=1)
    parser.add_argument("--policy", default="auto")
    parser.add_argument("--device-memory-gib", type=float, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="bench-false-alarm-")) / "run"
    cmd = [*ELASTIC, "run", "--nodes", str(args.nodes), "--fault-tolerance", "1", "--global-batch",
           str(args.global_batch), "--steps", str(args.steps), "--run-dir", str(run_dir), "--straggler-policy",
           args.policy, "--checkpoint-every", "0"]
    if args.device_memory_gib is not None:
        cmd += ["--device-memory-gib", str(args.device_memory_gib)]
    job = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert job.stdout is not None
    hogs: list[subprocess.Popen[bytes]] = []
    hog_at = None
    tail: list[str] = []
    try:
        for line in job.stdout:  # the run's own progress lines: no polling process beside it
            tail = [*tail[-40:], line]
            step = _step_of(line)
            if hog_at is None and step is not None and step >= args.steps // 2:
                hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(args.hogs)]
                hog_at = time.time()
                print(f"{args.hogs} hog(s) started after step {step}", flush=True)
        job.wait(timeout=600)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
        if job.poll() is None:
            job.kill()
            job.wait()
    out = "".join(tail)
    if job.returncode != 0:
        raise SystemExit(f"elastic run exited {job.returncode}:\n{out[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    lines = subprocess.run([*ELASTIC, "events", "--run-dir", str(run_dir), "--json"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.splitlines()
    events = [json.loads(line) for line in lines if line.strip()]
    marks = [{k: e.get(k) for k in ("kind", "node", "step", "factor", "reason")} for e in events
             if e.get("kind") in ("straggler", "straggler-cleared")]
    times = summary["step_committed_at"]
    before = [t for t in times if hog_at is None or t < hog_at]
    after = [t for t in times if hog_at is not None and t >= hog_at]
    result = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "steps_committed": summary["steps_committed"],
        "generations": sorted(set(summary["step_generations"])),
        "marks": marks,
        "steps_per_s_before_hogs": _rate(before),
        "steps_per_s_with_hogs": _rate(after),
        "final_loss": summary["losses"][-1],
    }
    print(json.dumps(result, indent=1))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    shutil.rmtree(run_dir.parent, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
