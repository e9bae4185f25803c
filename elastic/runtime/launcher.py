"""Local launcher: N simulated nodes x G worker processes on this machine.

Two modes. `launch` (fixed plan, no failure handling) is described below. `launch_elastic`
starts etcd (unless given one), writes the job's token-protected config, starts one agent per
node (elastic.runtime.agent: membership, leader, workers), publishes generation 1, prints each
committed step and each failure and recovery as it reads them from etcd, and counts restarts of
survivors' workers from the PIDs the workers register.

The launcher hosts the rendezvous store (a TCPStore on 127.0.0.1; the store is a parameter so
an etcd-backed one can take its place), writes the job spec, starts one worker subprocess per
(node, local rank), relays rank 0's progress to its own stdout, and watches every worker. It
stops every worker it started when the job ends, when any worker fails (naming that worker and
its exit code) or when it is interrupted.
"""

from __future__ import annotations

import os
import secrets
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

import torch.distributed as dist

from elastic.coordinator.access import admit
from elastic.coordinator.client import EtcdConfig, connect
from elastic.coordinator.election import current_leader
from elastic.coordinator.generations import Generations
from elastic.coordinator.keys import JobKeys
from elastic.runtime.job import JobSpec
from elastic.runtime.protocol import (
    COMMIT,
    ElasticConfig,
    GenerationRecord,
    RecoveryTimings,
    RunKeys,
    StepResult,
    WorkerInfo,
)
from elastic.runtime.summary import RunSummary, collect_summary

_POLL_S = 0.05
_STOP_GRACE_S = 5.0


class WorkerFailed(RuntimeError):
    """A worker exited with a non-zero code; every other worker has been stopped."""


@dataclass
class _Worker:
    node: int
    local_rank: int
    proc: subprocess.Popen[bytes]
    log: IO[bytes]
    log_path: Path


def host_store(*, timeout_s: float) -> tuple[dist.TCPStore, int]:
    """A TCPStore server on 127.0.0.1 at a free port, and that port."""
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
    )
    return store, store.port


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _stop(workers: list[_Worker]) -> None:
    """Stop every still-running worker by PID: SIGTERM, then SIGKILL after a grace period."""
    for w in workers:
        if w.proc.poll() is None:
            w.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + _STOP_GRACE_S
    for w in workers:
        remaining = max(0.0, deadline - time.monotonic())
        try:
            w.proc.wait(timeout=remaining)
        except subprocess.TimeoutExpired:
            w.proc.kill()
            w.proc.wait()
    for w in workers:
        w.log.close()


def launch(spec: JobSpec, *, quiet: bool = False, timeout_s: float | None = None) -> RunSummary:
    """Run `spec` to completion on local worker processes and return its summary.

    Raises WorkerFailed if a worker exits non-zero, TimeoutError past `timeout_s`.
    """
    run_dir = Path(spec.run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    spec_path = run_dir / "job.json"
    spec.save(spec_path)
    for stale in [spec.result_path, *(spec.stage_state_path(s) for s in range(spec.plan.num_layers))]:
        stale.unlink(missing_ok=True)
    store, port = host_store(timeout_s=spec.collective_timeout_s)
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(spec.threads_per_worker)
    workers: list[_Worker] = []
    start = time.monotonic()
    try:
        for node in sorted(spec.plan.nodes):
            for local_rank in range(spec.plan.gpus_per_node):
                log_path = spec.log_path(node, local_rank)
                log = open(log_path, "wb")  # noqa: SIM115 - closed in _stop
                is_rank0 = spec.plan.locate(node) == (0, 0) and local_rank == 0
                cmd = [
                    sys.executable, "-m", "elastic.runtime.worker",
                    "--spec", str(spec_path), "--node", str(node), "--local-rank", str(local_rank),
                    "--store-port", str(port),
                ]  # fmt: skip
                proc = subprocess.Popen(
                    cmd,
                    stdout=None if (is_rank0 and not quiet) else log,
                    stderr=log,
                    env=env,
                )
                workers.append(_Worker(node, local_rank, proc, log, log_path))
        _watch(workers, start=start, timeout_s=timeout_s)
    finally:
        _stop(workers)
        del store
    return collect_summary(spec)


def _watch(workers: list[_Worker], *, start: float, timeout_s: float | None) -> None:
    pending = list(workers)
    while pending:
        for w in list(pending):
            code = w.proc.poll()
            if code is None:
                continue
            if code != 0:
                raise WorkerFailed(
                    f"worker {w.local_rank} of node {w.node} (pid {w.proc.pid}) exited with code {code}; "
                    f"stopped all other workers. Last lines of {w.log_path}:\n{_tail(w.log_path)}"
                )
            pending.remove(w)
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            raise TimeoutError(f"job did not finish within {timeout_s:.0f} s; stopped all workers")
        time.sleep(_POLL_S)


# ---- elastic runs: etcd, one agent per node, live reconfiguration --------------------------


class JobFailed(RuntimeError):
    """An elastic job could not finish (no progress possible, or the leader gave up)."""


@dataclass
class _Agent:
    node: int
    incarnation: int
    proc: subprocess.Popen[bytes]
    log: IO[bytes]
    log_path: Path


@dataclass
class _Progress:
    """What the launcher has seen of an elastic run so far (read from etcd each poll)."""

    results: dict[int, Any] = field(default_factory=dict)
    printed: set[tuple[int, int]] = field(default_factory=set)
    generations: dict[int, Any] = field(default_factory=dict)
    reported: set[int] = field(default_factory=set)
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    pids: dict[tuple[int, int, int], set[int]] = field(default_factory=dict)
    rejoined: set[str] = field(default_factory=set)


def launch_elastic(
    config: ElasticConfig,
    *,
    etcd_endpoint: str | None = None,
    quiet: bool = False,
    timeout_s: float | None = None,
) -> RunSummary:
    """Run `config` with an agent per node (module doc of elastic.runtime.agent) and return its summary.

    Starts an etcd server unless `etcd_endpoint` is given. Raises JobFailed or TimeoutError;
    every process it started (etcd, agents, their workers) is stopped by PID on the way out.
    """
    from elastic.coordinator import EtcdServer

    started_at = time.time()
    spec = config.spec
    run_dir = Path(spec.run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    for stale in [spec.result_path, run_dir / "final_plan.json",
                  *(spec.stage_state_path(s) for s in range(spec.plan.num_layers))]:  # fmt: skip
        stale.unlink(missing_ok=True)
    server = None
    if etcd_endpoint is None:
        server = EtcdServer(data_dir=run_dir / "etcd").start()
        etcd_endpoint = server.endpoint
    job, token = f"run-{secrets.token_hex(4)}", secrets.token_hex(16)
    agents: list[_Agent] = []
    progress = _Progress()
    client = connect(EtcdConfig(endpoint=etcd_endpoint))
    keys = JobKeys(job)
    rk = RunKeys(keys)
    start = time.monotonic()

    def say(line: str) -> None:
        if not quiet:
            print(line, flush=True)

    def spawn(node: int, incarnation: int) -> None:
        log_path = run_dir / "logs" / f"agent{node}.inc{incarnation}.log"
        log = open(log_path, "wb")  # noqa: SIM115 - closed in _stop_agents
        env = dict(os.environ, ELASTIC_JOB_TOKEN=token, OMP_NUM_THREADS=str(spec.threads_per_worker))
        cmd = [sys.executable, "-m", "elastic.runtime.agent", "--etcd", etcd_endpoint, "--job", job,
               "--node", str(node), "--incarnation", str(incarnation)]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=env)
        agents.append(_Agent(node, incarnation, proc, log, log_path))

    try:
        admit(client, keys, token)
        client.put(rk.config, config.to_json())
        nodes = sorted(spec.plan.nodes)
        spawn(nodes[0], 0)  # the first node's agent becomes the leader: leader-failure runs can target it
        _wait_for(lambda: current_leader(client, keys) is not None, 60.0, "no leader elected", agents)
        for node in nodes[1:]:
            spawn(node, 0)
        world = len(nodes) * spec.plan.gpus_per_node
        _wait_for(lambda: _count(client, rk.workers) >= world, 120.0, "workers did not register", agents)
        first = GenerationRecord(plan=spec.plan, resume_step=0, incarnations=dict.fromkeys(nodes, 0))
        Generations(client, keys).publish(first.to_json(), expected=0)
        say(f"elastic run: job {job}, etcd {etcd_endpoint}, {len(nodes)} agents, generation 1 published")
        while True:
            _poll(client, keys, config, progress, say)
            for inj in config.injections:
                if inj.kind == "rejoin" and inj.name not in progress.rejoined and _step_in_flight(client, rk, inj.step):
                    progress.rejoined.add(inj.name)
                    client.put(rk.injected(inj.name), repr(time.time()))
                    incarnation = 1 + max(a.incarnation for a in agents if a.node == inj.node)
                    say(f"elastic run: node {inj.node} rejoins (incarnation {incarnation})")
                    spawn(inj.node, incarnation)
            fatal, _ = client.get(keys.root + "fatal")
            if fatal is not None:
                raise JobFailed(f"the leader gave up: {fatal.decode()}")
            if _finished(client, rk, progress, spec.steps):
                break
            if all(a.proc.poll() is not None for a in agents):
                _poll(client, keys, config, progress, say)
                if _finished(client, rk, progress, spec.steps):
                    break
                codes = ", ".join(f"node {a.node}.{a.incarnation}: {a.proc.returncode}" for a in agents)
                raise JobFailed(
                    f"every agent exited before step {spec.steps} was committed (exit codes {codes}); "
                    f"last lines of {agents[-1].log_path}:\n{_tail(agents[-1].log_path)}"
                )
            if timeout_s is not None and time.monotonic() - start > timeout_s:
                raise TimeoutError(f"job did not finish within {timeout_s:.0f} s; stopped everything")
            time.sleep(_POLL_S)
        _poll(client, keys, config, progress, say)
        return _elastic_summary(config, progress, started_at=started_at)
    finally:
        _stop_agents(agents)
        _kill_workers(progress)
        client.close()
        if server is not None:
            server.stop()


def _wait_for(cond: Callable[[], bool], timeout: float, what: str, agents: list[_Agent]) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        dead = [a for a in agents if a.proc.poll() is not None]
        if dead:
            raise JobFailed(f"agent of node {dead[0].node} exited: {_tail(dead[0].log_path)}")
        if time.monotonic() > deadline:
            raise JobFailed(f"{what} within {timeout:.0f} s")
        time.sleep(_POLL_S)


def _count(client: Any, prefix: str) -> int:
    return sum(1 for _ in client.get_prefix(prefix, keys_only=True))


def _step_in_flight(client: Any, rk: RunKeys, step: int | None) -> bool:
    """Whether step `step` (1-based) is in flight or past: step-1 was decided commit in some generation."""
    assert step is not None
    if step == 1:
        return True
    for value, meta in client.get_prefix(rk.steps):
        key = meta.key.decode()
        if key.endswith(f"/{step - 2}/decision") and value.decode() == COMMIT:
            return True
    return False


def _finished(client: Any, rk: RunKeys, progress: _Progress, steps: int) -> bool:
    if len(progress.results) < steps or not progress.generations:
        return False
    last = progress.generations[max(progress.generations)]
    done = {(int(m.key.decode().split("/")[-2]), int(m.key.decode().split("/")[-1]))
            for _, m in client.get_prefix(rk.done, keys_only=True)}  # fmt: skip
    return all((n, r) in done for n in last.plan.nodes for r in range(last.plan.gpus_per_node))


def _poll(client: Any, keys: JobKeys, config: ElasticConfig, progress: _Progress, say: Callable[[str], None]) -> None:
    rk = RunKeys(keys)
    spec = config.spec
    for value, meta in client.get_prefix(rk.workers):
        node, local_rank = (int(x) for x in meta.key.decode().split("/")[-2:])
        info = WorkerInfo.from_json(value)
        progress.pids.setdefault((node, local_rank, info.incarnation), set()).add(info.pid)
    for value, meta in client.get_prefix(keys.plans):
        g = int(meta.key.decode().rsplit("/", 1)[1])
        if g not in progress.generations:
            progress.generations[g] = GenerationRecord.from_json(value)
            rec = progress.generations[g]
            if g > 1:
                say(f"elastic run: generation {g}: {rec.reason} (resume at step {rec.resume_step + 1})")
    for value, _ in client.get_prefix(rk.results):
        r = StepResult.from_json(value)
        progress.results[r.step] = r
        if (r.step, r.generation) not in progress.printed:
            progress.printed.add((r.step, r.generation))
            tokens = spec.plan.global_batch * spec.model_config.seq_len
            say(f"step {r.step + 1}/{spec.steps}  loss {r.loss:.4f}  grad_norm {r.grad_norm:.3f}  lr {r.lr:.2e}  "
                f"{r.seconds * 1000:.0f} ms  {tokens / max(r.seconds, 1e-9):.0f} tok/s  (generation {r.generation})")  # fmt: skip
    for g, rec in sorted(progress.generations.items()):
        if g == 1 or g in progress.reported:
            continue
        world = len(rec.plan.nodes) * rec.plan.gpus_per_node
        timings = [RecoveryTimings.from_json(v) for v, _ in client.get_prefix(f"{rk.recoveries}{g}/")]
        superseded = any(later > g for later in progress.generations)
        trained = any(r.generation == g for r in progress.results.values())
        if len(timings) < world and not (superseded and (not trained or timings)):
            continue
        progress.reported.add(g)
        if not timings:  # a further failure cut this reconfiguration short
            say(f"elastic run: generation {g} (lost {rec.lost}, joined {rec.joined}) was superseded before it trained")
            progress.recoveries.append(_interrupted(g, rec))
            continue
        recovery = _recovery(client, rk, g, rec, timings)
        progress.recoveries.append(recovery)
        say(
            f"elastic run: recovered into generation {g} (lost {rec.lost}, joined {rec.joined}) in "
            f"{recovery['total_s']:.2f} s: detect {recovery['detecting_s']:.2f} s, plan {recovery['planning_s']:.2f} s, "
            f"transfer {recovery['transferring_s']:.2f} s, rebuild groups {recovery['rebuilding_s']:.2f} s, "
            f"replay {recovery['replaying_s']:.2f} s, {recovery['bytes_moved']} bytes moved"
            + (f", restored checkpoint of step {rec.restore_checkpoint}" if rec.restore_checkpoint is not None else "")
        )


def _interrupted(g: int, rec: GenerationRecord) -> dict[str, Any]:
    """A generation that never committed a step: superseded during its reconfiguration."""
    return {**_generation_fields(g, rec), "interrupted": True}


def _generation_fields(g: int, rec: GenerationRecord) -> dict[str, Any]:
    """What every recovery entry says about the generation it recovered into."""
    return {
        "generation": g,
        "lost_nodes": rec.lost,
        "joined_nodes": rec.joined,
        "restore_checkpoint": rec.restore_checkpoint,
        "reason": rec.reason,
    }


def _recovery(client: Any, rk: RunKeys, g: int, rec: GenerationRecord, timings: list[RecoveryTimings]) -> dict[str, Any]:
    """One recovery's breakdown; `total_s` runs from the injected fault (or the detection) to the first commit."""
    injected = []
    for node in rec.lost:
        for value, meta in client.get_prefix(rk.injected("")):
            if f"-node{node}-" in meta.key.decode():
                injected.append(float(value.decode()))
    detected = rec.detected_at if rec.detected_at is not None else rec.published_at or 0.0
    origin = min(injected) if injected and rec.lost else detected
    published = rec.published_at or detected
    first_commit = max(t.first_commit_at for t in timings)
    started = max(t.started_at for t in timings)
    return {
        **_generation_fields(g, rec),
        "detecting_s": max(0.0, detected - origin),
        "planning_s": max(0.0, published - detected),
        "transferring_s": max(t.transfer_s for t in timings),
        "rebuilding_s": max(t.rebuild_s for t in timings),
        "replaying_s": max(0.0, first_commit - started),
        "total_s": max(0.0, first_commit - origin),
        "bytes_moved": sum(t.bytes_fetched for t in timings),
        "interrupted": False,
    }


def _elastic_summary(config: ElasticConfig, progress: _Progress, *, started_at: float) -> RunSummary:
    spec = config.spec
    results = [progress.results[s] for s in sorted(progress.results)]
    restarts = sum(len(pids) - 1 for pids in progress.pids.values())
    tokens = spec.plan.global_batch * spec.model_config.seq_len
    seconds = [r.seconds for r in results]
    steady = seconds[1:] or seconds
    last = progress.generations[max(progress.generations)]
    wall = (results[-1].committed_at - results[0].committed_at + seconds[0]) if results else 0.0
    return RunSummary(
        steps_committed=len(results),
        losses=[r.loss for r in results],
        tokens_per_s=tokens * len(results) / wall if wall > 0 else 0.0,
        steady_step_s=statistics.median(steady) if steady else 0.0,
        step_seconds=seconds,
        grad_norms=[r.grad_norm for r in results],
        global_batch=spec.plan.global_batch,
        seq_len=spec.model_config.seq_len,
        world_size=len(last.plan.nodes) * last.plan.gpus_per_node,
        pipelines=len(last.plan.pipelines),
        recoveries=progress.recoveries,
        worker_restarts=restarts,
        startup_s=(results[0].committed_at - started_at) if results else 0.0,
        worker_pids={f"{n}/{r}/{i}": sorted(p) for (n, r, i), p in sorted(progress.pids.items())},
    )


def _stop_agents(agents: list[_Agent]) -> None:
    for a in agents:
        if a.proc.poll() is None:
            os.kill(a.proc.pid, signal.SIGCONT)  # a hung (stopped) agent cannot act on SIGTERM
            a.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + _STOP_GRACE_S
    for a in agents:
        try:
            a.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            a.proc.kill()
            a.proc.wait()
        a.log.close()


def _kill_workers(progress: _Progress) -> None:
    """SIGKILL any worker an agent left behind (a hung node's stopped workers), by registered PID."""
    import psutil

    for pids in progress.pids.values():
        for pid in pids:
            try:
                proc = psutil.Process(pid)
                if any("elastic.runtime.elastic_worker" in part for part in proc.cmdline()):
                    proc.kill()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
