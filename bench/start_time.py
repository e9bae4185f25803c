"""Start-up: warm parents (elastic/roles/zygote.py) against fresh interpreters, side by side (issue 32).

    .venv/bin/python bench/start_time.py [--starts 10] [--rounds 3] [--out bench/results-start.json]

Every figure is taken in both modes in the same invocation, alternating: `cold` is
ELASTIC_WARM=0 (every agent and worker a fresh interpreter that imports torch, the runtime
before issue 32), `warm` the default (the launcher's zygote forks agents and workers). All runs
are `elastic run` subprocesses of `tiny`, as a user starts them.

- node start: the agents' `started` events (elastic/roles/start_phases.py) of 2-node runs on an
  etcd of the bench's own, until `--starts` node starts per mode: agent start -> its worker
  registered, and worker start (the agent's decision) -> registered. p50 and max.
- step 1: a 4-node `elastic run` on its embedded etcd, from the command's start to its
  `step 1/` line; median of `--rounds`.
- rejoin: 4 nodes, node 2 killed at step 3 and rejoined at step 4: from the launcher's start of
  the new incarnation (its `injected/` stamp) to the generation that has node 2 again, and the
  run's losses against a failure-free run (the same in both modes, checked to 1e-5).
- spare: a 2-node run with `--spares 1`: the spare's agent start -> registered (a spare is
  ready to be planned in once registered).
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
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from elastic.coordinator import EtcdServer, JobKeys, connect  # noqa: E402
from elastic.coordinator.client import EtcdConfig  # noqa: E402
from elastic.coordinator.events import read_events  # noqa: E402
from elastic.coordinator.keys import RunKeys  # noqa: E402
from elastic.records.generation import GenerationRecord  # noqa: E402

MODES = ("cold", "warm")
TINY = ["--model", "tiny", "--fault-tolerance", "1", "--global-batch", "16", "--microbatch", "2"]


def _env(mode: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "ELASTIC_ZYGOTE"}
    env["ELASTIC_WARM"] = "0" if mode == "cold" else "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _elastic(args: list[str], mode: str, *, timeout: float = 300.0) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-m", "elastic.cli", "run", *args], env=_env(mode), capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"elastic run {' '.join(args)} ({mode}) failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def _events(etcd: str, job: str) -> list[dict[str, Any]]:
    client = connect(EtcdConfig(endpoint=etcd))
    try:
        return read_events(client, JobKeys(job))
    finally:
        client.close()


def node_starts(etcd: str, tmp: Path, starts: int) -> dict[str, dict[str, list[float]]]:
    """`started` events of 2-node runs, alternating modes, until `starts` per mode."""
    out: dict[str, dict[str, list[float]]] = {m: {"agent_to_registered": [], "worker_to_registered": []} for m in MODES}
    run = 0
    while any(len(out[m]["agent_to_registered"]) < starts for m in MODES):
        for mode in MODES:
            job = f"start-{mode}-{run}"
            _elastic([*TINY, "--nodes", "2", "--steps", "3", "--etcd", etcd, "--job", job,
                      "--run-dir", str(tmp / job)], mode)
            for e in _events(etcd, job):
                if e["kind"] == "started":
                    out[mode]["agent_to_registered"].append(e["total_s"])
                    out[mode]["worker_to_registered"].append(e["worker_s"])
        run += 1
    return {m: {k: v[:starts] for k, v in figs.items()} for m, figs in out.items()}


def step_one(tmp: Path, rounds: int) -> dict[str, list[float]]:
    """Seconds from `elastic run`'s start to its `step 1/` line (4 nodes, embedded etcd)."""
    out: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(rounds):
        for mode in MODES:
            began = time.monotonic()
            proc = subprocess.Popen(
                [sys.executable, "-m", "elastic.cli", "run", *TINY, "--nodes", "4", "--steps", "5",
                 "--run-dir", str(tmp / f"step1-{mode}-{r}")],
                env=_env(mode), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
            )
            assert proc.stdout is not None
            seen = None
            for line in proc.stdout:
                if seen is None and line.startswith("step 1/"):
                    seen = time.monotonic() - began
            if proc.wait() != 0 or seen is None:
                raise RuntimeError(f"the 4-node run ({mode}) failed")
            out[mode].append(seen)
    return out


def _losses(summary: Path) -> list[float]:
    return [float(x) for x in json.loads(summary.read_text())["losses"]]


def rejoin(etcd: str, tmp: Path, rounds: int) -> dict[str, Any]:
    """Rejoin start -> in the plan again, and the losses against the failure-free run."""
    steps = 60
    base = tmp / "rejoin-reference"
    _elastic([*TINY, "--nodes", "4", "--steps", str(steps), "--run-dir", str(base), "--summary", str(base / "s.json")],
             "warm")
    reference = _losses(base / "s.json")
    out: dict[str, Any] = {m: [] for m in MODES}
    worst = 0.0
    for r in range(rounds):
        for mode in MODES:
            job = f"rejoin-{mode}-{r}"
            run_dir = tmp / job
            _elastic([*TINY, "--nodes", "4", "--steps", str(steps), "--etcd", etcd, "--job", job,
                      "--run-dir", str(run_dir), "--summary", str(run_dir / "s.json"),
                      "--inject", "kill:node=2,step=3", "--inject", "rejoin:node=2,step=4"], mode)
            got = _losses(run_dir / "s.json")
            worst = max(worst, max(abs(a - b) / abs(b) for a, b in zip(got, reference, strict=True)))
            client = connect(EtcdConfig(endpoint=etcd))
            try:
                stamps = [float(v) for v, _ in client.get_prefix(RunKeys(JobKeys(job)).injected(""))]
                plans = [GenerationRecord.from_json(v) for v, _ in client.get_prefix(JobKeys(job).plans)]
            finally:
                client.close()
            started = max(stamps)  # the rejoin's stamp is the later one (the kill's comes first)
            planned = min(g.published_at for g in plans if (g.published_at or 0.0) > started and 2 in g.joined)
            out[mode].append(planned - started)
    out["max_loss_rel_diff"] = worst
    return out


def spare(etcd: str, tmp: Path, rounds: int) -> dict[str, list[float]]:
    """The hot spare's agent start -> registered."""
    out: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(rounds):
        for mode in MODES:
            job = f"spare-{mode}-{r}"
            _elastic([*TINY, "--nodes", "2", "--spares", "1", "--steps", "3", "--etcd", etcd, "--job", job,
                      "--run-dir", str(tmp / job)], mode)
            out[mode] += [e["total_s"] for e in _events(etcd, job) if e["kind"] == "started" and e["who"] == "node2"]
    return out


def _p50(xs: list[float]) -> float:
    return statistics.median(xs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--starts", type=int, default=10, help="node starts per mode (p50 over them)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the step-1, rejoin and spare figures")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="start-bench-") as d, EtcdServer(data_dir=Path(d) / "etcd") as server:
        tmp = Path(d)
        results = {
            "node_start": node_starts(server.endpoint, tmp, args.starts),
            "step_one": step_one(tmp, args.rounds),
            "rejoin": rejoin(server.endpoint, tmp, args.rounds),
            "spare": spare(server.endpoint, tmp, args.rounds),
        }
    ns, s1, rj, sp = results["node_start"], results["step_one"], results["rejoin"], results["spare"]
    print("| figure | cold (fresh interpreters) | warm (zygote) | warm / cold |")
    print("| --- | --- | --- | --- |")
    rows = [
        (f"agent start -> worker registered, p50 of {args.starts}", [ns[m]["agent_to_registered"] for m in MODES]),
        (f"worker start -> registered, p50 of {args.starts}", [ns[m]["worker_to_registered"] for m in MODES]),
        (f"`elastic run` 4 nodes: command -> `step 1`, median of {args.rounds}", [s1[m] for m in MODES]),
        (f"rejoin: new incarnation started -> in the plan, median of {args.rounds}", [rj[m] for m in MODES]),
        (f"spare: agent start -> registered, median of {args.rounds}", [sp[m] for m in MODES]),
    ]
    for name, (cold, warm) in rows:
        print(f"| {name} | {_p50(cold):.2f} s (max {max(cold):.2f}) | {_p50(warm):.2f} s (max {max(warm):.2f}) "
              f"| {_p50(warm) / _p50(cold):.2f}x |")
    print(f"rejoin runs: losses within {rj['max_loss_rel_diff']:.1e} of the failure-free run (both modes)")
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
