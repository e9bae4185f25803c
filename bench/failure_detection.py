"""How fast does every member learn that a node died?  (issue 5; target: < 1 s after SIGKILL)

    .venv/bin/python bench/failure_detection.py [--trials 20] [--observers 2] [--ttl 2]

A private etcd and `--observers` long-lived member processes run throughout. Each trial starts
a node agent (tests/coordinator/member_proc.py, role "agent") with one worker, SIGKILLs the
worker, and records, for every observer, the time from the kill until its membership watch
delivered the loss (time.monotonic(), shared by all processes on the host). The fast path is the
agent's pidfd monitor revoking its lease. The baseline, measured in the same run, is what a
node gets without it: the whole agent is SIGKILLed and the loss is seen only on lease expiry.
Prints median / p90 / max of both and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from elastic.coordinator import EtcdServer  # noqa: E402

MEMBER = str(REPO / "tests" / "coordinator" / "member_proc.py")


def _records(path: Path) -> list[dict[str, object]]:
    return (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    )


def _wait(pred, timeout: float):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.005)
    raise TimeoutError("bench step timed out")


def _summary(name: str, values: list[float]) -> str:
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, int(round(0.9 * (len(ordered) - 1))))]
    return (f"{name:<28} n={len(values):3d}  median={statistics.median(values) * 1e3:8.1f} ms  "
            f"p90={p90 * 1e3:8.1f} ms  max={ordered[-1] * 1e3:8.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=20, help="SIGKILL trials of the fast path")
    parser.add_argument("--baseline-trials", type=int, default=3, help="trials of the lease-expiry baseline")
    parser.add_argument("--observers", type=int, default=2, help="member processes that must see each loss")
    parser.add_argument("--ttl", type=int, default=2, help="lease TTL in seconds")
    args = parser.parse_args()

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with EtcdServer() as server, tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        procs: list[subprocess.Popen[bytes]] = []

        def start(node: str, role: str) -> Path:
            out = tmp / f"{node}.jsonl"
            procs.append(subprocess.Popen(
                [sys.executable, MEMBER, server.endpoint, "bench", node, str(out), str(args.ttl), role, "600"], env=env
            ))
            return out

        def loss_seen(obs: Path, node: str) -> float | None:
            return next(
                (float(r["t"]) for r in _records(obs) if r["event"] == "loss" and r["node"] == node), None
            )  # type: ignore[arg-type]

        try:
            observers = [start(f"obs{i}", "observer") for i in range(args.observers)]
            for obs in observers:
                _wait(lambda o=obs: any(r["event"] == "ready" for r in _records(o)), 60)
            fast: list[float] = []
            slow: list[float] = []
            for trial in range(args.trials + args.baseline_trials):
                baseline = trial >= args.trials
                node = f"{'base' if baseline else 'node'}{trial}"
                out = start(node, "agent")
                agent = procs[-1]
                _wait(lambda o=out: any(r["event"] == "ready" for r in _records(o)), 60)
                worker = next(int(r["pid"]) for r in _records(out) if r["event"] == "worker")  # type: ignore[call-overload]
                t0 = time.monotonic()
                os.kill(agent.pid if baseline else worker, signal.SIGKILL)
                for obs in observers:
                    seen = _wait(lambda o=obs, n=node: loss_seen(o, n), args.ttl + 10)
                    (slow if baseline else fast).append(seen - t0)
                os.kill(worker, signal.SIGKILL)
                agent.kill()
                agent.wait()
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
            # kill any worker left behind, by PID
            for path in tmp.glob("*.jsonl"):
                for r in _records(path):
                    if r["event"] == "worker":
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(int(r["pid"]), signal.SIGKILL)  # type: ignore[call-overload]

    print(f"failure detection: {args.observers} observers, lease TTL {args.ttl} s, etcd 127.0.0.1")
    print(_summary("worker SIGKILL (monitor)", fast))
    if slow:
        print(_summary("agent SIGKILL (lease expiry)", slow))
        print(
            f"ratio of medians (lease expiry / monitor): {statistics.median(slow) / statistics.median(fast):.1f}x"
        )
    print(f"fast path under 1 s: {sum(v < 1.0 for v in fast)}/{len(fast)}")


if __name__ == "__main__":
    main()
