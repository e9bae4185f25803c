"""What the control plane costs a failure-free run, and how that cost grows (issue 13).

    .venv/bin/python bench/control_plane.py                        # (a), (b) and (c)
    .venv/bin/python bench/control_plane.py --parts a --repeats 3  # one part

(a) overhead: the same `elastic run` (tiny, 2 nodes, f = 1, global batch 4, microbatch 2, no
    checkpoints) under the control plane and with `--static` (no etcd, no agents), one fresh
    launch each, in alternating rounds; the figure is each run's median step interval (the time
    between consecutive commits) over steps 21-300, and the ratio per round. Beside it, the cores
    each side's processes used by role (etcd, launcher, agents, workers; bench/process_cpu.py)
    between the printed lines of steps 50 and 250, and what all but the workers cost a step.
(b) drift: one run of 3000+ steps under the control plane on an etcd this script starts (the
    same EtcdServer, hence the same auto-compaction, as `elastic run`'s embedded one); the
    median step interval of the last 250 steps over that of steps 50-300, and at the end etcd's
    db size and the number of keys under the job's prefix.
(c) simulated scale: bench/control_plane_scale.py (W simulated workers against a real etcd,
    driving the real protocol, leader and rendezvous code).

Each part prints its table and, with --json, everything goes to one file.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.process_cpu import Sample, TreeCpu, cores_between  # noqa: E402
from bench.section import Section, attempt, exit_on_sigterm, series  # noqa: E402
from bench.stats import Figure  # noqa: E402

JOB_FLAGS = ["--model", "tiny", "--nodes", "2", "--fault-tolerance", "1", "--global-batch", "4",
             "--microbatch", "2"]
"""The job of parts (a) and (b): the issue's."""


def _run(run_dir: Path, steps: int, *, static: bool, etcd: str | None = None, timeout_s: float = 3600,
         window: tuple[int, int] | None = None) -> dict[str, Any]:
    """One `elastic run` of the job as a user starts it; its summary. With `window` (first, last
    step), also the cores its processes used by role (bench/process_cpu.py) from the printing of
    the first step's line to that of the last, under the summary's key "cores"."""
    summary = run_dir / "summary.json"
    argv = [sys.executable, "-m", "elastic.cli", "run", *JOB_FLAGS, "--steps", str(steps), "--run-dir", str(run_dir),
            "--summary", str(summary)]
    argv += ["--static"] if static else ["--checkpoint-every", "0"]
    if etcd is not None:
        argv += ["--etcd", etcd]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    marks = {} if window is None else {f"step {window[0]}/": 0, f"step {window[1]}/": 1}
    samples: list[Sample] = []
    tail: list[str] = []
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tree = TreeCpu(proc.pid)
    deadline = threading.Timer(timeout_s, proc.kill)
    deadline.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail = (tail + [line])[-20:]
            if any(line.startswith(mark) for mark in marks) and len(samples) < 2:
                samples.append(tree.sample())
        code = proc.wait()
    finally:
        deadline.cancel()
        if proc.poll() is None:
            proc.kill()
    if code != 0:
        raise RuntimeError(f"elastic run exited {code}: {''.join(tail).strip()[-400:]}")
    out = dict(json.loads(summary.read_text()))
    if len(samples) == 2:
        out["cores"] = cores_between(*samples)
    return out


def step_intervals(summary: dict[str, Any]) -> list[float]:
    """Seconds between consecutive commits; entry i is step i+1's interval (0-based steps)."""
    at = summary["step_committed_at"]
    return [b - a for a, b in zip(at, at[1:], strict=False)]


def median_interval(summary: dict[str, Any], first: int, last: int) -> float:
    """Median interval of steps first..last (1-based, inclusive)."""
    return statistics.median(step_intervals(summary)[first - 2 : last - 1])


def overhead(repeats: int, steps: int) -> Section:
    """(a) the control plane's step over `--static`'s, side by side."""
    section = Section(title=f"(a) control plane vs --static: tiny, 2 nodes, steps 21-{steps}")
    figures: dict[str, Figure] = {}
    window = (max(21, steps // 6), steps - steps // 6)  # the CPU sample's steps: 50-250 of 300
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-cp-") as tmp:
        for r in range(repeats):
            medians = {}
            for static in (False, True) if r % 2 == 0 else (True, False):
                name = "static" if static else "control plane"
                where = Path(tmp) / f"{name}-{r}"
                run = attempt(f"{name} round {r + 1}", lambda s=static, w=where: _run(w, steps, static=s, window=window),  # type: ignore[misc]
                              section)
                if run is None:
                    continue
                medians[name] = median_interval(run, 21, steps)
                series(figures, f"median step, {name}", "s", medians[name])
                cores = run.get("cores", {})
                for role, used in cores.items():
                    series(figures, f"cores of the {role} processes, {name}", "cores", used)
                if cores:
                    besides = sum(used for role, used in cores.items() if role != "worker")
                    series(figures, f"cores besides the workers, {name}", "cores", besides,
                           note=f"steps {window[0]}-{window[1]}")
                    series(figures, f"CPU besides the workers a step, {name}", "ms", besides * medians[name] * 1000)
                section.raw.append({"round": r, "side": name, "median_step_s": medians[name], "cores": cores})
            if len(medians) == 2:
                series(figures, "ratio control plane / static", "ratio", medians["control plane"] / medians["static"],
                       note="per round, then the median")
    section.figures = list(figures.values())
    section.wall_s = time.monotonic() - t0
    return section


def _key_families(names: list[str]) -> dict[str, int]:
    """Keys left under the job prefixes, counted by family: `/elastic/<job>/` cut off and every run
    of digits shown as `#` (so `sync/3/node1/0` counts under `sync/#/node#/#`). Lease-attached
    families (members/, workers/, holdings/) may or may not have expired when the run ends."""
    families: dict[str, int] = {}
    for name in names:
        rest = name.split("/", 3)[3] if name.count("/") >= 3 else name
        family = re.sub(r"[0-9]+", "#", rest)
        families[family] = families.get(family, 0) + 1
    return dict(sorted(families.items()))


def drift(steps: int) -> Section:
    """(b) step time late in a long run over early in it, and etcd's size at the end."""
    from elastic.coordinator import EtcdServer
    from elastic.coordinator.client import EtcdConfig, connect

    section = Section(title=f"(b) drift over {steps} steps under the control plane")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-drift-") as tmp, EtcdServer() as server:
        client = connect(EtcdConfig(endpoint=server.endpoint))
        run = attempt("long run", lambda: _run(Path(tmp) / "run", steps, static=False, etcd=server.endpoint), section, retries=0)
        if run is not None:
            early = median_interval(run, 50, 300)
            late = median_interval(run, steps - 249, steps)
            status = client.status()
            names = [meta.key.decode() for _, meta in client.get_prefix("/elastic/", keys_only=True)]
            keys = len(names)
            section.figures = [
                Figure(name="median step, steps 50-300", unit="s", samples=[early]),
                Figure(name=f"median step, steps {steps - 249}-{steps}", unit="s", samples=[late]),
                Figure(name="drift: late / early", unit="ratio", samples=[late / early]),
                Figure(name="etcd db size at the end", unit="MB", samples=[status.db_size / 1e6]),
                Figure(name="etcd keys under /elastic/ at the end", unit="keys", samples=[float(keys)]),
            ]
            blocks = [statistics.median(step_intervals(run)[i : i + 250]) for i in range(0, steps - 1, 250)]
            section.notes.append("median step by blocks of 250 steps (ms): " + " / ".join(f"{b * 1000:.0f}" for b in blocks))
            section.notes.append("keys at the end by family: " + ", ".join(
                f"{family} {count}" for family, count in _key_families(names).items()))
            section.raw.append({"early_s": early, "late_s": late, "db_size": status.db_size, "keys": keys,
                                "key_families": _key_families(names), "blocks_s": blocks})
        client.close()
    section.wall_s = time.monotonic() - t0
    return section


def scale(workers: list[int], steps: int) -> Section:
    """(c) the simulated cluster of bench/control_plane_scale.py."""
    from bench.control_plane_scale import run_scale

    section = Section(title=f"(c) simulated scale: W = {', '.join(map(str, workers))} workers, real etcd")
    t0 = time.monotonic()
    rows = run_scale(workers, steps=steps)
    section.raw = rows
    for row in rows:
        for key, value in row.items():
            if key != "workers" and isinstance(value, int | float):
                series_name = f"W={row['workers']}: {key}"
                section.figures.append(Figure(name=series_name, unit="", samples=[float(value)]))
    section.wall_s = time.monotonic() - t0
    return section


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", choices=("a", "b", "c"), default=["a", "b", "c"])
    parser.add_argument("--repeats", type=int, default=3, help="(a): rounds of both sides")
    parser.add_argument("--steps", type=int, default=300, help="(a): steps per run")
    parser.add_argument("--drift-steps", type=int, default=3000, help="(b): steps of the long run")
    parser.add_argument("--workers", type=int, nargs="+", default=[8, 64, 256, 1024], help="(c): simulated W")
    parser.add_argument("--sim-steps", type=int, default=100, help="(c): simulated failure-free steps")
    parser.add_argument("--json", type=Path, help="write every section here")
    args = parser.parse_args(argv)
    exit_on_sigterm()
    sections = []
    if "a" in args.parts:
        sections.append(overhead(args.repeats, args.steps))
        print("\n".join(sections[-1].lines()), flush=True)
    if "b" in args.parts:
        sections.append(drift(args.drift_steps))
        print("\n".join(sections[-1].lines()), flush=True)
    if "c" in args.parts:
        sections.append(scale(args.workers, args.sim_steps))
        print("\n".join(sections[-1].lines()), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps([s.to_dict() for s in sections], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
