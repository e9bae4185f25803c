"""Elastic runs of `tiny` on real processes (etcd, agents, workers) and what they are compared with."""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from elastic.engine.optim import OptimConfig
from elastic.planning.cluster import ClusterSpec
from elastic.planning.stragglers import StragglerConfig
from elastic.records.config import ElasticConfig
from elastic.records.injection import parse_injection
from elastic.records.job import JobSpec
from elastic.records.progress import ProgressRecord, StepResult, committed_steps, waiting_for_steps
from elastic.records.summary import RunSummary, load_final_state
from elastic.roles.launcher import launch_elastic
from templates.plan import even_plan

STEPS = 20
OPTIM = OptimConfig(lr=1e-3, warmup_steps=2, eps=1e-6)  # eps: see tests/engine/runs.py
TOLERANCE = 1e-5

Result = tuple[RunSummary, dict[str, torch.Tensor]]
"""A run's summary and its final parameters (canonical name -> full fp32 tensor)."""


def run_elastic(
    run_dir: Path,
    *,
    nodes: int,
    pipelines: int,
    fault_tolerance: int = 1,
    inject: tuple[str, ...] = (),
    checkpoint_every: int = 5,
    steps: int = STEPS,
    timeout_s: float = 150.0,
    partial_replay: bool = True,
    shard_transport: str = "collective",
    virtual_stages: int = 1,
) -> Result:
    """Train tiny on `nodes` nodes dealt into `pipelines` multi-stage pipelines, with faults."""
    config = tiny_config(run_dir, nodes=nodes, pipelines=pipelines, steps=steps, fault_tolerance=fault_tolerance,
                         checkpoint_every=checkpoint_every, partial_replay=partial_replay,
                         shard_transport=shard_transport, virtual_stages=virtual_stages)
    config = dataclasses.replace(config, injections=tuple(parse_injection(i) for i in inject))
    summary = launch_elastic(config, quiet=True, timeout_s=timeout_s)
    return summary, load_final_state(config.spec)


def max_rel_diff(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """Largest, over parameters, of max|state - reference| / max|reference|."""
    assert state.keys() == reference.keys()
    worst = 0.0
    for name, ref in reference.items():
        assert state[name].shape == ref.shape, name
        worst = max(worst, float((state[name] - ref).abs().max() / ref.abs().max().clamp_min(1e-12)))
    return worst


def check_same_training(
    summary: RunSummary,
    state: dict[str, torch.Tensor],
    reference: tuple[RunSummary, dict[str, torch.Tensor]],
    *,
    steps: int = STEPS,
) -> None:
    """The run committed every step, its losses and final parameters match the failure-free run,
    and no survivor's worker was restarted (each worker of a node incarnation registered one PID)."""
    ref_summary, ref_state = reference
    assert summary.steps_committed == steps
    assert len(summary.losses) == steps
    for step, (got, want) in enumerate(zip(summary.losses, ref_summary.losses, strict=True)):
        assert abs(got - want) <= TOLERANCE * abs(want), f"step {step + 1}: loss {got} vs failure-free {want}"
    diff = max_rel_diff(state, ref_state)
    assert diff <= TOLERANCE, f"final state differs from the failure-free run by {diff:.2e}"
    assert summary.worker_restarts == 0
    assert all(len(pids) == 1 for pids in summary.worker_pids.values()), summary.worker_pids


def tiny_config(
    run_dir: Path, *, nodes: int, pipelines: int, steps: int, fault_tolerance: int = 1, lease_ttl: int = 3,
    checkpoint_every: int = 5, partial_replay: bool = True, shard_transport: str = "collective",
    global_microbatches: int = 4, virtual_stages: int = 1,
) -> ElasticConfig:
    """tiny on `nodes` nodes dealt into `pipelines` pipelines (global batch 8 in microbatches of 2,
    unless `global_microbatches` says otherwise: `static_reference` has 4), `virtual_stages`
    chunks per node (the re-plans' too)."""
    plan = even_plan(num_layers=6, nodes=list(range(nodes)), num_pipelines=pipelines,
                     global_microbatches=global_microbatches, microbatch_size=2, fault_tolerance=fault_tolerance,
                     virtual_stages=virtual_stages)
    spec = JobSpec(model="tiny", plan=plan, steps=steps, run_dir=str(run_dir), optim=OPTIM, device="cpu",
                   collective_timeout_s=60.0, partial_replay=partial_replay,
                   shard_transport=shard_transport)
    cluster = ClusterSpec(
        model="tiny", nodes=nodes, fault_tolerance=fault_tolerance, global_batch=2 * global_microbatches, microbatch=2,
        virtual_stages=virtual_stages,
    )
    # These runs count generations and recoveries: a straggler mark on a loaded test machine must
    # not add one (the straggler policies have tests of their own, test_stragglers*.py).
    return ElasticConfig(spec=spec, cluster=cluster, checkpoint_every=checkpoint_every, lease_ttl=lease_ttl,
                         stragglers=StragglerConfig(policy="report"))


def static_reference(run_dir: Path, *, steps: int, global_microbatches: int = 4) -> Result:
    """The failure-free result on a single worker: the parameters and losses after K steps do not
    depend on the plan (DESIGN.md invariant 1), so one process stands for any elastic plan."""
    from elastic.roles.static_launcher import launch

    plan = even_plan(num_layers=6, nodes=[0], num_pipelines=1, global_microbatches=global_microbatches,
                     microbatch_size=2, fault_tolerance=0)
    spec = JobSpec(model="tiny", plan=plan, steps=steps, run_dir=str(run_dir), optim=OPTIM, device="cpu")
    summary = launch(spec, quiet=True, timeout_s=300)
    return summary, load_final_state(spec)


_REFERENCES: dict[tuple[int, int], Result] = {}


def reference_run(factory: pytest.TempPathFactory, *, steps: int, global_microbatches: int = 4) -> Result:
    """`static_reference`, computed once per pytest session, number of steps and global batch,
    and shared by the modules that compare against it."""
    key = (steps, global_microbatches)
    if key not in _REFERENCES:
        _REFERENCES[key] = static_reference(factory.mktemp("reference"), steps=steps,
                                            global_microbatches=global_microbatches)
    return _REFERENCES[key]


class LiveJob:
    """`launch_elastic(config)` in a background thread on the caller's etcd, with a known job id
    and token, so that the test can drive it (CLI, requests) and read its etcd afterwards."""

    def __init__(self, config: ElasticConfig, *, etcd: str, job: str | None = None, token: str | None = None,
                 timeout_s: float = 150.0, rejoin_fenced: int = 0) -> None:
        import secrets

        from elastic.coordinator import JobKeys, connect
        from elastic.coordinator.credentials import config_from_env
        from elastic.coordinator.keys import RunKeys

        self.config, self.etcd = config, etcd
        self.job = job or f"h2-{secrets.token_hex(4)}"
        self.token = token or secrets.token_hex(8)
        self.keys = JobKeys(self.job)
        self.rk = RunKeys(self.keys)
        self.client = connect(config_from_env(etcd))
        self.summary: RunSummary | None = None
        self.error: BaseException | None = None
        self._timeout_s, self._rejoin_fenced = timeout_s, rejoin_fenced
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="live-job", daemon=True)
        self.progress_puts: list[tuple[ProgressRecord, int]] = []
        """Every put of the job's progress key (one per committed step) and its revision, in
        order, seen by a watch from before the run's start."""
        self._progress_lock = threading.Lock()
        self._progress_watch: Any = None

    def _run(self) -> None:
        try:
            self.summary = launch_elastic(self.config, etcd_endpoint=self.etcd, quiet=True,
                                          timeout_s=self._timeout_s, job=self.job, token=self.token,
                                          stop=self._stop, rejoin_fenced=self._rejoin_fenced)
        except BaseException as exc:  # handed to the test thread by result()
            self.error = exc

    def start(self) -> LiveJob:
        from elastic.coordinator.watch import watch_from_now

        self._progress_watch = watch_from_now(self.client, self.rk.progress, self._on_progress)
        self._thread.start()
        return self

    def _on_progress(self, events: list[Any]) -> None:
        with self._progress_lock:
            self.progress_puts += [(ProgressRecord.from_json(ev.value), ev.revision) for ev in events
                                   if ev.kind == "put" and ev.key == self.rk.progress]

    def progress_seen(self) -> list[tuple[ProgressRecord, int]]:
        """A copy of `progress_puts`."""
        with self._progress_lock:
            return list(self.progress_puts)

    def committed(self) -> int:
        """Steps committed so far."""
        return committed_steps(self.client, self.rk)

    def wait_committed(self, steps: int, timeout: float = 120.0) -> None:
        """Until `steps` steps are committed, as a step waiter (the progress key at its short
        interval, as while an agent's injection waits: what a test does next lands as promptly)."""
        deadline = time.monotonic() + timeout
        with waiting_for_steps(self.client, self.rk):
            while self.committed() < steps:
                if self.error is not None or not self._thread.is_alive():
                    raise AssertionError(f"the run ended before step {steps} was committed: {self.error!r}")
                if time.monotonic() > deadline:
                    raise AssertionError(f"step {steps} not committed within {timeout} s")
                time.sleep(0.05)

    def generation(self) -> int:
        """The latest published generation (0 before the first)."""
        value, _ = self.client.get(self.keys.generation)
        return int(value) if value is not None else 0

    def job_keys(self, *, moving: bool = True) -> dict[str, bytes]:
        """Every key under the job's prefix, with its value; without the ones that move on with
        the run itself (the progress record, the speed factors and their straggler events, and
        the last step's marks and the done keys that its end writes) when `moving` is False."""
        from elastic.records.stragglers import stragglers_key

        keys = {meta.key.decode(): value for value, meta in self.client.get_prefix(self.keys.root)}
        ending = (self.rk.prefix("ready"), self.rk.prefix("decisions"), self.rk.done)
        # The election moves when the first agent leaves.
        moved = (self.rk.progress, self.keys.leader, stragglers_key(self.keys))

        def speed_event(key: str, value: bytes) -> bool:
            return key.startswith(self.keys.events) and json.loads(value).get("kind", "").startswith("straggler")

        return keys if moving else {k: v for k, v in keys.items()
                                    if k not in moved and not k.startswith(ending) and not speed_event(k, v)}

    def leased_prefixes(self) -> list[str]:
        """Prefixes of the keys that live on an agent's lease (gone when the agent leaves)."""
        return [self.keys.members, self.rk.workers, self.rk.holdings, self.keys.prefix("metrics")]

    def result(self) -> Result:
        """Wait for the run's end; its summary and final state (re-raises the run's error)."""
        self._thread.join(self._timeout_s + 30.0)
        assert not self._thread.is_alive(), "the run did not stop"
        if self.error is not None:
            raise self.error
        assert self.summary is not None
        return self.summary, load_final_state(self.config.spec)

    def cli(self, *argv: str) -> tuple[int, str]:
        """Run `elastic ARGV --etcd .. --job .. --token ..` in this process: (exit code, output)."""
        import contextlib
        import io

        from elastic.cli.main import main

        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = main([*argv, "--etcd", self.etcd, "--job", self.job, "--token", self.token])
        return code, out.getvalue()

    def close(self) -> None:
        """Stop the run if it still goes (the launcher stops every process it started, by PID)."""
        self._stop.set()
        self._thread.join(60.0)
        if self._progress_watch is not None:
            self._progress_watch.cancel()
        self.client.close()


def step_logs(run_dir: Path) -> dict[str, list[StepResult]]:
    """Every local step log of a run (`<run_dir>/steps/*.jsonl`, one per pipeline-first worker):
    file name -> its step results in the order written (a torn line of a killed writer skipped)."""
    out: dict[str, list[StepResult]] = {}
    for path in sorted((run_dir / "steps").glob("*.jsonl")):
        results = []
        for line in path.read_text().splitlines():
            try:
                results.append(StepResult.from_json(line))
            except (ValueError, TypeError, KeyError):
                continue
        out[path.name] = results
    return out


def signal_other_thread(pid: int, sig: int) -> int:
    """Send `sig` to a thread of process `pid` other than its main thread (tgkill): the case of a
    process-directed signal that the kernel hands to a helper thread (gRPC's, a monitor's), whose
    Python handler must still run soon. The thread id it went to."""
    others = [t.id for t in psutil.Process(pid).threads() if t.id != pid]
    assert others, f"process {pid} has no thread besides its main one"
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.tgkill(pid, others[0], sig) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return others[0]


def agent_pid(job: str, node: int) -> int:
    """PID of the agent process of `node` in `job`, found by its command line (an agent started
    another way, as torchrun starts one with its settings in the environment, is not it)."""
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if ("elastic.roles.agent" in cmd and "--job" in cmd[:-1] and "--node" in cmd[:-1]
                and cmd[cmd.index("--job") + 1] == job and cmd[cmd.index("--node") + 1] == str(node)):
            return int(proc.pid)
    raise AssertionError(f"no agent process for node {node} of job {job}")
