"""Failure detection per fault, before and after issue 56's suspect guard (two witnesses).

    .venv/bin/python bench/detection.py --repeat 3                 # --before /tmp/before, --cases ..., --json FILE

Each measurement is one fresh live job: tiny on 4 nodes (two 2-stage pipelines), f = 1, no
checkpoints, lease TTL 3 s, 30 steps, on an etcd of its own (fsync off, as in the test suite:
this machine's disk stalls fdatasync for seconds at times). Once step 8 is committed the fault
lands on a node that does not lead (or on the three that do not), signals sent by this script
to PIDs read beforehand:

- `worker-kill`: the node's workers SIGKILLed; its agent's monitor reports the crash (fast path);
- `node-kill`: agent and workers SIGKILLed (agent first): found by the lease's expiry;
- `node-hang`: agent and workers SIGSTOPped (agent first): found by the lease's expiry (and,
  after the guard, a probe that is not answered within its deadline);
- `stall-kill`: etcd SIGSTOPped for 5 s, the node SIGKILLed whole 0.5 s into the stall (every
  lease of the job expires in the stall: before the guard every node is lost);
- `mass-kill`: three of four nodes SIGKILLed whole at once: with no checkpoint the job stops
  ("shards ... have no live holder"); two rows, kill -> detected and kill -> the leader gave up.

"Detected" is the leader's abort halt of the generation (its `at`, stamped with the recovery's
`detected_at`); "stopped" the leader's `fatal` event. Both are wall times on this host, as the
fault's. "Before" runs the same measurement in a checkout of the commit before the guard
(`--before`, e.g. `git worktree add /tmp/before <commit>`) with PYTHONPATH and the working
directory set to it; "after" in this repository. Each run is a subprocess of this script (`--one
CASE`) that imports only what both trees have (tests/faults/runs.py's LiveJob); it checks that
`elastic` comes from the tree it was started in. Runs alternate before/after per case; the table
gives the median of `--repeat` runs and the outcome of the last run of each.
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
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CASES = ("worker-kill", "node-kill", "node-hang", "stall-kill", "mass-kill")
ROWS = (
    ("worker-kill", "detected_s", "node's workers SIGKILLed (its monitor reports)"),
    ("node-kill", "detected_s", "node SIGKILLed whole (lease expiry)"),
    ("node-hang", "detected_s", "node SIGSTOPped whole (hang)"),
    ("stall-kill", "detected_s", "node SIGKILLed 0.5 s into a 5 s etcd stall"),
    ("mass-kill", "detected_s", "3 of 4 nodes SIGKILLed: detected"),
    ("mass-kill", "stopped_s", "3 of 4 nodes SIGKILLed: job stopped"),
)
"""(case, figure, what the row says)."""
NODES, STEPS, FAULT_AT, TTL_S = 4, 30, 8, 3
STALL_S, KILL_INTO_STALL_S = 5.0, 0.5
RUN_TIMEOUT_S = 240.0
RESULT = "RESULT "


# ---- one measurement (`--one CASE`, in the tree under test) ----------------------------------


def _pids(run: Any, nodes: list[int]) -> tuple[list[int], list[int]]:
    """(agents, workers) of `nodes`."""
    from elastic.records.node_workers import read_registrations
    from tests.faults.runs import agent_pid

    agents = [agent_pid(run.job, n) for n in nodes]
    workers = [info.pid for n in nodes for info in read_registrations(run.client, run.rk, node=n).values()]
    return agents, workers


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _inject(case: str, etcd_pid: int, agents: list[int], workers: list[int]) -> float:
    """Carry out the fault; the wall time of the fault itself (the SIGKILL or SIGSTOP)."""
    if case == "worker-kill":
        at = time.time()
        _signal(workers, signal.SIGKILL)
    elif case == "node-hang":
        at = time.time()
        _signal([*agents, *workers], signal.SIGSTOP)
    elif case == "stall-kill":
        os.kill(etcd_pid, signal.SIGSTOP)
        try:
            time.sleep(KILL_INTO_STALL_S)
            at = time.time()
            _signal([*agents, *workers], signal.SIGKILL)
            time.sleep(STALL_S - KILL_INTO_STALL_S)
        finally:
            os.kill(etcd_pid, signal.SIGCONT)
    else:
        at = time.time()
        _signal([*agents, *workers], signal.SIGKILL)
    return at


class _Seen:
    """What the leader saw and did, as this script's watches deliver it: when the first victim's
    member key went (its lease expired or was revoked; this process's clock at delivery) and the
    wall time of the first abort halt the leader wrote (its `at`)."""

    def __init__(self, run: Any, victims: list[int]) -> None:
        from elastic.coordinator.watch import PrefixWatch
        from elastic.records.workers import node_id

        self.expired: float | None = None
        self.halted: float | None = None
        self.seen = threading.Event()
        self._members = {run.keys.member(node_id(n)) for n in victims}
        self._watches = [PrefixWatch(run.client, run.rk.halts, self._on_halts),
                         PrefixWatch(run.client, run.keys.members, self._on_members)]
        for watch in self._watches:
            watch.wait_ready(10.0)

    def _on_halts(self, events: list[Any]) -> None:
        for ev in events:
            if ev.kind == "put" and self.halted is None and json.loads(ev.value).get("abort"):
                self.halted = float(json.loads(ev.value)["at"])
                self.seen.set()

    def _on_members(self, events: list[Any]) -> None:
        if self.expired is None and any(ev.kind == "delete" and ev.key in self._members for ev in events):
            self.expired = time.time()

    def cancel(self) -> None:
        for watch in self._watches:
            watch.cancel()


def _outcome(run: Any) -> tuple[str, float | None]:
    """How the run ended, in a few words, and when it failed (wall time; None: it finished)."""
    try:
        summary, _ = run.result()
    except Exception as exc:  # noqa: BLE001 - the failure is the outcome
        text = str(exc)
        return ("stopped: no live holder" if "no live holder" in text else
                "stopped: every agent exited" if "every agent exited" in text else f"stopped: {text[:60]}"), time.time()
    lost = sorted({n for r in summary.recoveries for n in r["lost_nodes"]})
    return f"recovered, lost {lost}", None


def measure(case: str, root: Path) -> dict[str, Any]:
    """One fresh job, one fault: seconds from the fault to its detection (and to the job's stop)."""
    from elastic.coordinator import EtcdServer
    from elastic.coordinator.election import current_leader
    from elastic.coordinator.events import read_events
    from elastic.records.workers import node_of
    from tests.faults.runs import LiveJob, tiny_config

    server = EtcdServer(data_dir=root / "etcd").start()
    config = tiny_config(root / "run", nodes=NODES, pipelines=2, steps=STEPS, checkpoint_every=0, lease_ttl=TTL_S)
    run = LiveJob(config, etcd=server.endpoint, job=f"detect-{case}", timeout_s=RUN_TIMEOUT_S)
    agents: list[int] = []
    workers: list[int] = []
    try:
        run.start()
        run.wait_committed(FAULT_AT, 120.0)
        leader = current_leader(run.client, run.keys)
        others = [n for n in (2, 3, 1, 0) if leader is None or n != node_of(leader)]
        victims = others if case == "mass-kill" else others[:1]
        agents, workers = _pids(run, victims)
        seen = _Seen(run, victims)
        assert server.pid is not None
        fault_at = _inject(case, server.pid, agents, workers)
        deadline = time.monotonic() + 60.0
        while not seen.seen.wait(0.2) and run.error is None and time.monotonic() < deadline:
            pass  # found, or the run failed without a halt (an etcd stall fenced every node before the guard)
        if case == "node-hang":
            _signal([*agents, *workers], signal.SIGKILL)  # found (or not): let the job end
        outcome, failed_at = _outcome(run)
        seen.cancel()
        fatal = [float(e["time"]) for e in read_events(run.client, run.keys) if e["kind"] == "fatal"]
        stopped = fatal[0] if fatal else failed_at  # the leader gave up, or else the launcher's end
        return {"case": case, "victims": victims, "outcome": outcome,
                "expired_s": None if seen.expired is None else round(seen.expired - fault_at, 3),
                "detected_s": None if seen.halted is None else round(seen.halted - fault_at, 3),
                "stopped_s": None if stopped is None else round(stopped - fault_at, 3)}
    finally:
        _signal([*agents, *workers], signal.SIGKILL)
        run.close()
        server.stop()


def _one(case: str) -> None:
    with contextlib.suppress(ValueError):  # this script's folder: nothing of it may shadow the tree's modules
        sys.path.remove(str(Path(__file__).resolve().parent))
    import elastic

    tree = Path.cwd().resolve()
    where = Path(elastic.__file__).resolve()
    assert where.is_relative_to(tree), f"elastic imported from {where}, not from {tree}: set PYTHONPATH"
    with tempfile.TemporaryDirectory(prefix=f"detect-{case}-") as tmp:
        result = measure(case, Path(tmp))
    print(RESULT + json.dumps({**result, "tree": str(tree)}), flush=True)


# ---- the comparison -------------------------------------------------------------------------


def _run_in(tree: Path, case: str) -> dict[str, Any]:
    """`--one CASE` in a subprocess that imports `tree`'s code."""
    env = {**os.environ, "PYTHONPATH": str(tree), "ELASTIC_ETCD_NO_FSYNC": "1"}
    env.pop("ELASTIC_ZYGOTE", None)
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--one", case], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S + 120.0)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        raise RuntimeError(f"{case} in {tree} failed (exit {proc.returncode}):\n{tail}")
    result: dict[str, Any] = json.loads(lines[-1][len(RESULT):])
    return result


def _median(results: list[dict[str, Any]], figure: str) -> float | None:
    values = [r[figure] for r in results if r.get(figure) is not None]
    return statistics.median(values) if values else None


def _leader_part(results: list[dict[str, Any]], figure: str) -> float | None:
    """Median of `figure` - expired: the leader's part, from the victim's member key's deletion on."""
    values = [r[figure] - r["expired_s"] for r in results
              if r.get(figure) is not None and r.get("expired_s") is not None]
    return statistics.median(values) if values else None


def _cell(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def table(results: dict[tuple[str, str], list[dict[str, Any]]], repeat: int) -> str:
    """The markdown table: per row, the medians before and after, their difference, the outcomes."""
    lines = [f"| case (median of {repeat}) | before s | after s | after - before | key gone -> figure, before / after "
             "| outcome before / after |", "| --- | --- | --- | --- | --- | --- |"]
    for case, figure, what in ROWS:
        if (case, "before") not in results:
            continue
        before, after = _median(results[case, "before"], figure), _median(results[case, "after"], figure)
        delta = None if before is None or after is None else after - before
        diff = "n/a" if delta is None else f"{delta:+.2f}"
        outcomes = f"{results[case, 'before'][-1]['outcome']} / {results[case, 'after'][-1]['outcome']}"
        leader = " / ".join(_cell(_leader_part(results[case, tree], figure)) for tree in ("before", "after"))
        lines.append(f"| {what} | {_cell(before)} | {_cell(after)} | {diff} | {leader} | {outcomes} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=1, help="runs per case and tree (the table gives the median)")
    parser.add_argument("--before", type=Path, default=Path("/tmp/before"), help="checkout of the code before the guard")
    parser.add_argument("--after", type=Path, default=REPO, help="checkout with the guard (this repository)")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--json", type=Path, default=None, help="write every run's result here")
    parser.add_argument("--one", choices=CASES, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        _one(args.one)
        return
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for i in range(args.repeat):
        for case in args.cases:
            for name, tree in trees.items():
                result = _run_in(tree, case)
                results.setdefault((case, name), []).append(result)
                print(f"[{i + 1}/{args.repeat}] {case:<12} {name:<6} detected {_cell(result['detected_s'])} s, "
                      f"stopped {_cell(result['stopped_s'])} s: {result['outcome']}", file=sys.stderr, flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps([r for rs in results.values() for r in rs], indent=1))
    print(table(results, args.repeat))


if __name__ == "__main__":
    main()
