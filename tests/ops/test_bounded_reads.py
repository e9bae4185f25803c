"""Readers of a job's progress read a number of keys that does not depend on how many steps ran,
and the job's etcd keys do not grow with steps (DESIGN.md invariant 6; issue 13).

Against a real etcd, a job is written the way the step protocol writes it (plan/1, its workers,
one `progress` put per committed step; `ready/` and `decisions/` for the last step only), for
a short and a long run. Every reader (`elastic status`, `committed_steps`, the launcher's feed,
poll and finish check, its rejoin-at-step check) goes through a client that counts the keys each
read returns: the counts must be the same after 400 steps as after 10. With per-step keys
(`steps/<g>/<s>/...`, `results/<s>`) they grew by a few keys a step.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elastic.coordinator import EtcdConfig, EtcdServer, JobKeys, connect
from elastic.coordinator.generations import Generations
from elastic.coordinator.keys import RunKeys
from elastic.engine.optim import OptimConfig
from elastic.ops.status_read import read_status
from elastic.planning.cluster import ClusterSpec
from elastic.records.config import ElasticConfig
from elastic.records.generation import GenerationRecord
from elastic.records.job import JobSpec
from elastic.records.progress import ProgressRecord, StepResult, committed_steps, step_log_path
from elastic.records.sync import COMMIT
from elastic.records.workers import WorkerInfo
from elastic.roles.launcher_feed import (
    JobFeed,
    Progress,
    elastic_summary,
    final_poll,
    poll_progress,
    run_finished,
)
from elastic.roles.run_loop import _step_in_flight
from templates.plan import even_plan

from ..polling import wait_for

pytestmark = pytest.mark.timeout(120)

SHORT, LONG = 10, 400
NODES, GPUS = 2, 1


class CountingClient:
    """The real client, counting the reads made and the keys they returned."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.reads = 0
        self.keys = 0

    def __getattr__(self, name: str) -> Any:  # watches (channel, credentials), puts, leases
        return getattr(self._inner, name)

    def reset(self) -> None:
        self.reads = self.keys = 0

    def get(self, key: str, **kwargs: Any) -> tuple[Any, Any]:
        self.reads += 1
        value, meta = self._inner.get(key, **kwargs)
        self.keys += value is not None
        return value, meta

    def _many(self, items: Any) -> Iterator[tuple[Any, Any]]:
        self.reads += 1
        got = list(items)
        self.keys += len(got)
        return iter(got)

    def get_prefix(self, prefix: str, **kwargs: Any) -> Iterator[tuple[Any, Any]]:
        return self._many(self._inner.get_prefix(prefix, **kwargs))

    def get_range(self, start: str, end: str, **kwargs: Any) -> Iterator[tuple[Any, Any]]:
        return self._many(self._inner.get_range(start, end, **kwargs))

    def get_all(self, **kwargs: Any) -> Iterator[tuple[Any, Any]]:
        return self._many(self._inner.get_all(**kwargs))

    def _response(self, resp: Any) -> Any:
        self.reads += 1
        self.keys += len(resp.kvs)
        return resp

    def get_response(self, key: str, **kwargs: Any) -> Any:
        return self._response(self._inner.get_response(key, **kwargs))

    def get_prefix_response(self, prefix: str, **kwargs: Any) -> Any:
        return self._response(self._inner.get_prefix_response(prefix, **kwargs))

    def get_range_response(self, start: str, end: str, **kwargs: Any) -> Any:
        return self._response(self._inner.get_range_response(start, end, **kwargs))

    def get_all_response(self, **kwargs: Any) -> Any:
        return self._response(self._inner.get_all_response(**kwargs))


def job_config(run_dir: Path, steps: int) -> ElasticConfig:
    plan = even_plan(num_layers=6, nodes=list(range(NODES)), num_pipelines=1, global_microbatches=4,
                     microbatch_size=2, fault_tolerance=0)
    spec = JobSpec(model="tiny", plan=plan, steps=steps, run_dir=str(run_dir), optim=OptimConfig(lr=1e-3),
                   device="cpu")
    cluster = ClusterSpec(model="tiny", nodes=NODES, fault_tolerance=0, global_batch=8, microbatch=2)
    return ElasticConfig(spec=spec, cluster=cluster, checkpoint_every=0)


def record(step: int, recent: list[list[float]]) -> ProgressRecord:
    at = 1000.0 + 0.25 * step
    recent = [*recent, [float(step), at, 0.2]][-8:]
    return ProgressRecord(step=step, loss=3.0 - step / 1000, grad_norm=1.0, lr=1e-3, seconds=0.2, generation=1,
                          committed_at=at, recent=recent)


def start_job(client: Any, keys: JobKeys, config: ElasticConfig) -> None:
    """What the launcher and the agents write before the first step: config, workers, plan/1."""
    rk = RunKeys(keys)
    client.put(rk.config, config.to_json())
    for node in range(NODES):
        for local_rank in range(GPUS):
            info = WorkerInfo(pid=1000 + node, transfer_address=f"127.0.0.1:{7000 + node}", incarnation=0)
            client.put(rk.worker(node, local_rank), info.to_json())
    first = GenerationRecord(plan=config.spec.plan, resume_step=0, incarnations=dict.fromkeys(range(NODES), 0))
    Generations(client, keys).publish(first.to_json(), expected=0)


def train(client: Any, keys: JobKeys, config: ElasticConfig, steps: int) -> None:
    """The per-step writes of `steps` committed steps: one progress put each (world rank 0), one
    local step-log line each (the pipeline's first worker); the last step is decided through
    etcd (every rank's ready mark, the leader's decision) and every worker says done."""
    rk = RunKeys(keys)
    log = step_log_path(config.spec.run_dir, 0, 0)
    log.parent.mkdir(parents=True, exist_ok=True)
    recent: list[list[float]] = []
    with open(log, "a") as out:
        for s in range(steps):
            rec = record(s, recent)
            recent = rec.recent
            if s == steps - 1:
                for rank in range(NODES * GPUS):
                    client.put(rk.ready(1, s, rank), "ok")
                client.put(rk.decision(1, s), COMMIT)
            client.put(rk.progress, rec.to_json())
            out.write(rec.result().to_json() + "\n")
    for node in range(NODES):
        for local_rank in range(GPUS):
            client.put(rk.worker_done(node, local_rank), "1")


def key_count(client: Any, keys: JobKeys) -> int:
    return int(client.get_prefix_response(keys.root, count_only=True).count)


def keys_read(client: CountingClient, read: Any) -> int:
    client.reset()
    read()
    return client.keys


def measure(client: CountingClient, inner: Any, etcd: str, run_dir: Path, steps: int) -> dict[str, Any]:
    """Run a job of `steps` steps on a fresh prefix; keys each reader read and what it returned."""
    keys = JobKeys(f"bounded-{uuid.uuid4().hex[:8]}")
    rk = RunKeys(keys)
    config = job_config(run_dir, steps)
    feed = JobFeed(client, rk)  # the launcher opens its feed before anything is written
    try:
        start_job(inner, keys, config)
        train(inner, keys, config, steps)
        progress, lines, polls = Progress(), [], []

        def poll() -> bool:
            polls.append(keys_read(client, lambda: poll_progress(client, keys, config, progress, lines.append, feed)))
            return progress.committed == steps and 1 in progress.generations and len(progress.pids) == NODES * GPUS

        wait_for(poll, 60.0, f"the feed to deliver {steps} progress records, plan/1 and the workers")
        return {
            "poll": max(polls),
            "status": keys_read(client, lambda: read_status(client, keys, etcd=etcd)),
            "committed": keys_read(client, lambda: committed_steps(client, rk)),
            "finished": keys_read(client, lambda: run_finished(client, rk, progress, steps)),
            "in_flight": keys_read(client, lambda: _step_in_flight(client, rk, steps, Progress())),
            "final": keys_read(client, lambda: final_poll(client, keys, config, progress, lines.append, feed)),
            "job_keys": key_count(inner, keys),
            "status_json": json.loads(read_status(client, keys, etcd=etcd).to_json()),
            "done": run_finished(client, rk, progress, steps),
            "lines": lines,
            "summary": elastic_summary(config, progress, started_at=999.0),
        }
    finally:
        feed.close()


@pytest.fixture
def measured(etcd_server: EtcdServer, tmp_path: Path) -> dict[int, dict[str, Any]]:
    """For a SHORT and a LONG run: keys each reader read, what it returned, the job's key count."""
    inner = connect(EtcdConfig(endpoint=etcd_server.endpoint))
    try:
        client = CountingClient(inner)
        return {steps: measure(client, inner, etcd_server.endpoint, tmp_path / f"run{steps}", steps)
                for steps in (SHORT, LONG)}
    finally:
        inner.close()


def test_readers_read_as_many_keys_after_many_steps(measured: dict[int, dict[str, Any]]) -> None:
    short, long = measured[SHORT], measured[LONG]
    for reader in ("poll", "status", "committed", "finished", "in_flight", "final"):
        assert short[reader] == long[reader], (reader, short[reader], long[reader])
    assert long["committed"] == 1 and long["in_flight"] == 1 and long["poll"] == 0


def test_job_keys_do_not_grow_with_steps(measured: dict[int, dict[str, Any]]) -> None:
    assert measured[SHORT]["job_keys"] == measured[LONG]["job_keys"]


@pytest.mark.parametrize("steps", [SHORT, LONG])
def test_readers_see_every_step(measured: dict[int, dict[str, Any]], steps: int) -> None:
    m = measured[steps]
    last = record(steps - 1, [])
    status = m["status_json"]
    assert status["committed_steps"] == status["reported_steps"] == steps and status["state"] == "finished"
    assert status["last_loss"] == pytest.approx(last.loss)
    throughput = status["throughput"]
    assert throughput["window_steps"] == 5 and throughput["last_step_s"] == pytest.approx(0.2)
    assert throughput["tokens_per_s"] == pytest.approx(8 * 64 * 5 / (4 * 0.25 + 0.2))
    assert m["done"]
    # One line a committed step, in order, from the watch on the progress key.
    assert [line.split()[1] for line in m["lines"]] == [f"{s + 1}/{steps}" for s in range(steps)]
    summary = m["summary"]
    assert summary.steps_committed == steps and summary.step_generations == [1] * steps
    assert summary.losses == [record(s, []).loss for s in range(steps)]


def test_summary_takes_the_steps_the_feed_missed_from_the_step_logs(tmp_path: Path) -> None:
    config = job_config(tmp_path, 6)
    log = step_log_path(tmp_path, 1, 0)
    log.parent.mkdir(parents=True)
    logged = [StepResult(step=s, loss=2.0 - s / 10, grad_norm=1.0, lr=1e-3, seconds=0.3, generation=1,
                         committed_at=50.0 + s) for s in range(6)]
    log.write_text("".join(r.to_json() + "\n" for r in logged) + '{"step": 6, "lo')  # a torn last line
    progress = Progress(generations={1: GenerationRecord(plan=config.spec.plan, resume_step=0, incarnations={})})
    recent: list[list[float]] = []
    for s in (0, 1, 5):  # the feed saw three steps (the progress writer's own figures)
        rec = record(s, recent)
        recent = rec.recent
        progress.saw(rec, revision=100 + s)
    summary = elastic_summary(config, progress, started_at=0.0)
    assert summary.steps_committed == 6
    assert summary.losses == [record(0, []).loss, record(1, []).loss, *(r.loss for r in logged[2:5]),
                              record(5, []).loss]
    assert summary.step_seconds == [0.2, 0.2, 0.3, 0.3, 0.3, 0.2]


@pytest.mark.slow
def test_etcd_server_compacts_its_history(tmp_path: Path) -> None:
    """The embedded etcd runs with auto-compaction: old revisions of an overwritten key go."""
    with EtcdServer(data_dir=tmp_path / "etcd", auto_compaction=("periodic", "1s")) as server:
        client = connect(EtcdConfig(endpoint=server.endpoint))
        try:
            first = client.put("/compaction/progress", "0").header.revision
            for i in range(1, 50):
                client.put("/compaction/progress", str(i))

            def compacted() -> bool:
                client.put("/compaction/progress", "more")  # the compactor compacts only if revisions move on
                try:
                    client.get_response("/compaction/progress", revision=first)
                except Exception as exc:  # etcd's OUT_OF_RANGE "required revision has been compacted"
                    return "compacted" in str(exc)
                return False

            wait_for(compacted, 30.0, "etcd to compact the history of an overwritten key")
        finally:
            client.close()
