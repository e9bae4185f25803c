"""A run's committed steps: the `progress` key (`ProgressRecord`, one put a step by world rank 0)
and the local step logs of `StepResult`s.

Per-step results (loss, norm, lr, seconds) are appended by each pipeline's first worker to its
local log `<run_dir>/steps/node<N>.worker<L>.jsonl` (see `step_log_path`), which the summary
reads at the end; etcd keeps no per-step history.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from elastic.coordinator.etcd_api import EtcdClient
from elastic.coordinator.jsonrecord import JsonRecord, RecordError
from elastic.coordinator.keys import RunKeys


def read_progress(client: EtcdClient, rk: RunKeys) -> ProgressRecord | None:
    """The job's progress record (one key read); None before the first commit."""
    value, _ = client.get(rk.progress)
    return None if value is None else ProgressRecord.from_json(value)


def committed_steps(client: EtcdClient, rk: RunKeys) -> int:
    """How many steps the job has committed, from the progress record (one key read)."""
    record = read_progress(client, rk)
    return 0 if record is None else record.step + 1


def add_step_waiter(client: EtcdClient, rk: RunKeys, *, lease: int | None = None) -> str:
    """Put a `step-waiters/<id>` key (on `lease`, if given) and return it: while it is there,
    world rank 0's progress writer puts the `progress` key at its short interval
    (`PROGRESS_MIN_INTERVAL_S`, elastic/roles/worker_feeds.py), so whoever waits for a step to be
    committed sees it within that interval rather than the idle one."""
    key = rk.job.key("step-waiters", uuid.uuid4().hex[:16])
    client.put(key, "", lease=lease)
    return key


def drop_step_waiter(client: EtcdClient, key: str) -> None:
    """Delete a key of `add_step_waiter`; left behind (etcd away), it only keeps the progress
    writer at its short interval (until its lease ends, if it has one)."""
    with contextlib.suppress(Exception):
        client.delete(key)


@contextlib.contextmanager
def waiting_for_steps(client: EtcdClient, rk: RunKeys, *, lease: int | None = None) -> Iterator[None]:
    """Hold a step waiter (`add_step_waiter`) while inside."""
    key = add_step_waiter(client, rk, lease=lease)
    try:
        yield
    finally:
        drop_step_waiter(client, key)


def step_log_path(run_dir: str | Path, node: int, local_rank: int) -> Path:
    """The local log of per-step results that worker (node, local_rank) appends to while it is
    the first worker (stage 0, tensor-parallel rank 0) of a pipeline: one StepResult JSON a line."""
    return Path(run_dir) / "steps" / f"node{node}.worker{local_rank}.jsonl"


def read_step_logs(run_dir: str | Path) -> dict[int, StepResult]:
    """Every step result in the run's local step logs, by step (the newest generation's copy of a
    step wins; a torn last line of a killed writer is skipped)."""
    out: dict[int, StepResult] = {}
    for path in sorted((Path(run_dir) / "steps").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                r = StepResult.from_json(line)
            except RecordError:
                continue
            if r.step not in out or r.generation >= out[r.step].generation:
                out[r.step] = r
    return out


@dataclass(frozen=True, kw_only=True)
class ProgressRecord(JsonRecord):
    """The `progress` key: the last committed step and a short window of the steps before it.
    Readers (launcher, status, metrics, inject) read this one key, never a per-step history."""

    step: int
    """Index of the last committed step (0-based); `step + 1` steps are committed."""
    loss: float
    """Its mean global-batch loss."""
    grad_norm: float
    """Its global gradient norm before clipping."""
    lr: float
    """Its learning rate."""
    seconds: float
    """Its wall time on the writer, step start to commit."""
    generation: int
    """The generation that committed it."""
    committed_at: float
    """Wall time of its commit on the writer."""
    recent: list[list[float]] = field(default_factory=list)
    """[step, committed_at, seconds] of up to the last 8 steps committed, oldest first, this
    one last (steps the writer committed; a new writer after a re-plan starts a new window)."""
    earlier: list[list[float]] = field(default_factory=list)
    """[step, loss, grad_norm, lr, seconds, committed_at] of the steps of this record's
    generation committed since the previous record was written, oldest first, this one left out (the writer writes at most
    every `PROGRESS_MIN_INTERVAL_S`, or `PROGRESS_IDLE_INTERVAL_S` while no one waits on a step,
    so fast steps share a record); empty when none."""

    def result(self) -> StepResult:
        """The last step as a StepResult."""
        return StepResult(step=self.step, loss=self.loss, grad_norm=self.grad_norm, lr=self.lr,
                          seconds=self.seconds, generation=self.generation, committed_at=self.committed_at)

    def results(self) -> list[StepResult]:
        """Every step this record reports, oldest first: the `earlier` ones, then its own."""
        out = [StepResult(step=int(s), loss=loss, grad_norm=norm, lr=lr, seconds=sec, generation=self.generation,
                          committed_at=at) for s, loss, norm, lr, sec, at in self.earlier]
        return [*out, self.result()]


@dataclass(frozen=True, kw_only=True)
class StepResult(JsonRecord):
    """What a committed step produced: the step engine's result of a commit (elastic/engine/step.py),
    which the progress writer publishes and each pipeline's first worker appends to its local log."""

    step: int
    """Index of the step (0-based)."""
    loss: float
    """Mean global-batch loss."""
    grad_norm: float
    """Global gradient norm before clipping."""
    lr: float
    """Learning rate applied (0 for a step skipped because its gradient is not finite)."""
    seconds: float
    """Wall time of the step on the committing worker, prepare to commit."""
    generation: int
    """Generation that committed it."""
    committed_at: float
    """Wall time of the commit on the committing worker."""
