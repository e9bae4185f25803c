"""An elastic run of `tiny` in a background thread, for faults the test itself injects
(etcd restarts, whole-node kills, intruders), plus the cheap failure-free reference."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from elastic.coordinator import EtcdConfig, JobKeys, connect
from elastic.runtime.job import JobSpec
from elastic.runtime.launcher import launch, launch_elastic
from elastic.runtime.planning import ClusterSpec
from elastic.runtime.protocol import ElasticConfig, RunKeys
from elastic.runtime.summary import RunSummary, load_final_state
from templates.plan import even_plan

from ..polling import wait_for
from .runs import OPTIM

Result = tuple[RunSummary, dict[str, torch.Tensor]]


def _spec(run_dir: Path, *, nodes: int, pipelines: int, fault_tolerance: int, steps: int) -> JobSpec:
    plan = even_plan(num_layers=6, nodes=list(range(nodes)), num_pipelines=pipelines, global_microbatches=4,
                     microbatch_size=2, fault_tolerance=fault_tolerance)  # fmt: skip
    return JobSpec(model="tiny", plan=plan, steps=steps, run_dir=str(run_dir), optim=OPTIM, device="cpu",
                   collective_timeout_s=60.0)  # fmt: skip


_REFERENCES: dict[int, Result] = {}


def reference_run(factory: pytest.TempPathFactory, *, steps: int) -> Result:
    """The failure-free result on one worker (the parameters after K steps do not depend on the
    plan: DESIGN.md invariant 1, proved by tests/engine), so it costs one process; computed once
    per pytest session and number of steps, shared by the modules that compare against it."""
    if steps not in _REFERENCES:
        spec = _spec(factory.mktemp("reference"), nodes=1, pipelines=1, fault_tolerance=0, steps=steps)
        summary = launch(spec, quiet=True, timeout_s=120)
        _REFERENCES[steps] = (summary, load_final_state(spec))
    return _REFERENCES[steps]


class LiveRun:
    """`launch_elastic` on `nodes` nodes against the caller's etcd, running in a thread."""

    def __init__(self, run_dir: Path, *, etcd: str, job: str, token: str, nodes: int, pipelines: int,
                 steps: int, timeout_s: float = 150.0) -> None:  # fmt: skip
        self.spec = _spec(run_dir, nodes=nodes, pipelines=pipelines, fault_tolerance=1, steps=steps)
        cluster = ClusterSpec(model="tiny", nodes=nodes, fault_tolerance=1, global_batch=8, microbatch=2)
        self.config = ElasticConfig(spec=self.spec, cluster=cluster, checkpoint_every=5)
        self.etcd, self.job, self.token = etcd, job, token
        self.keys = JobKeys(job)
        self.rk = RunKeys(self.keys)
        self.client = connect(EtcdConfig(endpoint=etcd))
        self._timeout_s = timeout_s
        self._summary: RunSummary | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="live-run", daemon=True)

    def _run(self) -> None:
        try:
            self._summary = launch_elastic(self.config, etcd_endpoint=self.etcd, quiet=True,
                                           timeout_s=self._timeout_s, job=self.job, token=self.token)  # fmt: skip
        except BaseException as exc:  # re-raised in result()
            self._error = exc

    def start(self) -> LiveRun:
        self._thread.start()
        return self

    def committed(self) -> int:
        """Steps committed so far (each has its result key)."""
        return sum(1 for _ in self.client.get_prefix(self.rk.results, keys_only=True))

    def wait_committed(self, steps: int, timeout: float) -> None:
        wait_for(lambda: self.committed() >= steps or not self._thread.is_alive(), timeout,
                 f"step {steps} to be committed")  # fmt: skip
        if not self._thread.is_alive():
            self.result()
            raise AssertionError(f"the run ended before step {steps} was committed")

    def generation(self) -> int:
        value, _ = self.client.get(self.keys.generation)
        return int(value) if value is not None else 0

    def job_keys(self) -> dict[str, bytes]:
        """Every key under the job's prefix, with its value."""
        return {meta.key.decode(): value for value, meta in self.client.get_prefix(self.keys.root)}

    def result(self, timeout: float | None = None) -> Result:
        """Wait for the run to end; its summary and final parameters (or its exception)."""
        self._thread.join(timeout if timeout is not None else self._timeout_s + 30.0)
        assert not self._thread.is_alive(), "launch_elastic did not return"
        if self._error is not None:
            raise self._error
        assert self._summary is not None
        return self._summary, load_final_state(self.spec)

    def close(self) -> None:
        self.client.close()


def pids_alive(pids: list[int]) -> list[int]:
    import psutil

    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]

