"""The per-node Prometheus endpoint against a real elastic run: real etcd, agents, workers, SIGKILL.

One run (tiny, 3 nodes: a 2-stage and a 1-stage pipeline, node 2 killed while step 5 is in
flight) serves every test of this module. A NodeMetrics for the surviving node 1 runs in the test
process, on node 1's own lease, and is scraped over HTTP during and after the run; every value is
checked against the run summary or etcd.
"""

from __future__ import annotations

import threading
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from elastic.coordinator import EtcdConfig, EtcdServer, JobKeys, connect
from elastic.coordinator.keys import RunKeys
from elastic.engine.optim import OptimConfig
from elastic.ops.metrics import NodeMetrics, metrics_addresses
from elastic.ops.metrics_snapshot import snapshot
from elastic.ops.report import summary_text, write_report
from elastic.parallel.layout import assign_ranks
from elastic.planning.cluster import ClusterSpec
from elastic.records.config import ElasticConfig
from elastic.records.generation import GenerationRecord
from elastic.records.injection import parse_injection
from elastic.records.job import JobSpec
from elastic.records.progress import ProgressRecord, read_progress
from elastic.records.recovery_timings import SUMMARY_NODE, ReconfigTimings, RecoveryTimings
from elastic.records.stragglers import StragglerRecord, read_stragglers
from elastic.records.summary import RunSummary
from elastic.records.workers import node_id
from elastic.roles.launcher import launch_elastic
from templates.plan import even_plan

from ..polling import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

STEPS = 10
NODE = 1  # survives; node 2 is killed
SEQ_LEN = 64  # the tiny preset's


def scrape(address: str) -> dict[str, float]:
    """`name{labels}` -> value of every sample the endpoint serves."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


@dataclass
class Live:
    """What the module's run left: the summary, samples scraped during and after, etcd's view."""

    summary: RunSummary
    job: str
    run_dir: Path
    address: str
    published_during: dict[str, str]
    published_after: dict[str, str]
    during: dict[str, float]
    after: dict[str, float]
    plans: dict[int, GenerationRecord]
    timings: dict[int, dict[int, RecoveryTimings]]
    progress: ProgressRecord | None
    stragglers: StragglerRecord | None = None


def elastic_config(run_dir: Path) -> ElasticConfig:
    plan = even_plan(num_layers=6, nodes=[0, 1, 2], num_pipelines=2, global_microbatches=4, microbatch_size=2,
                     fault_tolerance=1)
    spec = JobSpec(model="tiny", plan=plan, steps=STEPS, run_dir=str(run_dir),
                   optim=OptimConfig(lr=1e-3, warmup_steps=2, eps=1e-6), device="cpu", collective_timeout_s=60.0)
    cluster = ClusterSpec(model="tiny", nodes=3, fault_tolerance=1, global_batch=8, microbatch=2)
    return ElasticConfig(spec=spec, cluster=cluster, injections=(parse_injection("kill:node=2,step=5"),),
                         checkpoint_every=0)


@pytest.fixture(scope="module")
def live(etcd_server: EtcdServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    run_dir = tmp_path_factory.mktemp("metrics-run")
    job = f"metrics-{uuid.uuid4().hex[:8]}"
    keys = JobKeys(job)
    client = connect(EtcdConfig(endpoint=etcd_server.endpoint))
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["summary"] = launch_elastic(elastic_config(run_dir), etcd_endpoint=etcd_server.endpoint,
                                                job=job, quiet=True, timeout_s=120)
        except BaseException as exc:  # reported by the fixture below
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="elastic-run", daemon=True)
    thread.start()
    metrics = None
    try:
        member = wait_for(lambda: client.get(keys.member(node_id(NODE)))[1], 90, "node 1 to join")
        metrics = NodeMetrics(client, keys, node=NODE, lease=member.lease_id).start()
        address = metrics.address
        assert address is not None
        published_during = metrics_addresses(client, keys)

        def two_steps() -> dict[str, float] | None:
            samples = scrape(address)
            if samples.get("elastic_step", 0) >= 2 or not thread.is_alive():  # a failed run: raised below
                return samples
            return None

        during: dict[str, float] = wait_for(two_steps, 110, "two committed steps on the endpoint")
        thread.join(timeout=130)
        assert not thread.is_alive(), "the elastic run did not end"
        if "error" in outcome:
            raise outcome["error"]
        summary: RunSummary = outcome["summary"]
        (run_dir / "summary.json").write_text(summary.to_json())
        rk = RunKeys(keys)
        # Node 1's agent left at the end: the worker keys on its lease went (the last delete
        # reaches the mirror through a watch), while every result and timing stays.
        wait_for(lambda: scrape(address)["elastic_workers"] == 0, 10, "node 1's workers to go")
        after = scrape(address)
        plans = {int(m.key.decode().rsplit("/", 1)[1]): GenerationRecord.from_json(v)
                 for v, m in client.get_prefix(keys.plans)}
        timings: dict[int, dict[int, RecoveryTimings]] = {}
        for value, m in client.get_prefix(rk.recoveries):
            g, node = m.key.decode().split("/")[-2:]  # node "all": a superseded generation's summary
            timings.setdefault(int(g), {})[SUMMARY_NODE if node == "all" else int(node)] = RecoveryTimings.from_json(value)
        yield Live(summary=summary, job=job, run_dir=run_dir, address=address, published_during=published_during,
                   published_after=metrics_addresses(client, keys), during=during, after=after, plans=plans,
                   timings=timings, progress=read_progress(client, rk), stragglers=read_stragglers(client, keys))
    finally:
        if metrics is not None:
            metrics.stop()
        thread.join(timeout=30)  # launch_elastic stops its agents and workers by PID on the way out
        client.close()


def test_run_had_one_recovery(live: Live) -> None:
    assert live.summary.steps_committed == STEPS
    (rec,) = live.summary.recoveries
    assert rec["lost_nodes"] == [2] and not rec["interrupted"]


def test_address_published_on_the_nodes_lease(live: Live) -> None:
    assert live.published_during[node_id(NODE)] == live.address
    assert live.address.startswith("127.0.0.1:")
    assert node_id(NODE) not in live.published_after  # the lease went with the agent


def test_values_during_the_run(live: Live) -> None:
    s = live.during
    assert s[f'elastic_node_info{{job_id="{live.job}",node="1"}}'] == 1
    step = int(s["elastic_step"])
    assert 2 <= step <= STEPS
    assert s["elastic_loss"] == live.summary.losses[step - 1]
    assert s["elastic_workers"] == 1 and s["elastic_workers_alive"] == 1
    assert 2 <= s["elastic_nodes_alive"] <= 3


def test_speed_of_the_node_is_the_stragglers_record(live: Live) -> None:
    """elastic_node_busy_seconds, _speed_factor and _straggler: node 1's entries of the record
    world rank 0 wrote (elastic/records/stragglers.py), read at scrape time."""
    record = live.stragglers
    assert record is not None and NODE in record.factors, record
    assert live.after["elastic_node_speed_factor"] == record.factors[NODE]
    assert live.after["elastic_node_straggler"] == float(NODE in record.marked)
    # Busy seconds need a full window of steps under the last plan (a short last generation has none).
    assert live.after.get("elastic_node_busy_seconds") == record.busy.get(NODE)


def test_values_after_the_run(live: Live) -> None:
    s, summary = live.after, live.summary
    assert s["elastic_step"] == summary.steps_committed == STEPS
    assert s["elastic_loss"] == summary.losses[-1]
    assert s["elastic_step_seconds"] == summary.step_seconds[-1]
    assert s["elastic_generation"] == max(live.plans) == summary.recoveries[-1]["generation"] == 2
    assert s["elastic_recoveries_total"] == len(summary.recoveries) == 1
    assert s["elastic_workers"] == 0 and s["elastic_workers_alive"] == 0


def test_tokens_per_second_over_the_last_ten_commits(live: Live) -> None:
    # Over the last 10 commits, or fewer: the progress record keeps a window of at most 8.
    assert live.progress is not None
    # Its steps are the last k committed; each time is the progress writer's commit of that step.
    # The summary may hold another pipeline's commit of a step the feed missed (its first
    # worker's step log), which ends the same all-reduce a few milliseconds apart.
    recent = live.progress.recent[-10:]
    k = len(recent)
    assert k >= 2 and [int(s) for s, _, _ in recent] == list(range(STEPS - k, STEPS))
    at = [c for _, c, _ in recent]
    assert at == pytest.approx(live.summary.step_committed_at[-k:], abs=0.25)
    want = live.summary.global_batch * SEQ_LEN * (k - 1) / (at[-1] - at[0])
    assert live.after["elastic_tokens_per_second"] == pytest.approx(want, rel=1e-9)


def test_recovery_seconds_match_the_summary(live: Live) -> None:
    s, (rec,) = live.after, live.summary.recoveries
    assert s["elastic_last_recovery_seconds"] == pytest.approx(rec["total_s"], abs=1e-9)
    for phase in ("detecting", "planning", "transferring", "rebuilding", "replaying"):
        got = s[f'elastic_last_recovery_phase_seconds{{phase="{phase}"}}']
        assert got == pytest.approx(rec[f"{phase}_s"], abs=1e-9), phase
    assert s["elastic_recovery_seconds_count"] == 1
    assert s["elastic_recovery_seconds_sum"] == pytest.approx(rec["total_s"], abs=1e-9)
    assert s['elastic_recovery_seconds_bucket{le="+Inf"}'] == 1


def test_bytes_transferred(live: Live) -> None:
    (rec,) = live.summary.recoveries
    assert live.after["elastic_job_transfer_bytes_total"] == rec["bytes_moved"] > 0
    # One record a node, folding exactly the ranks that generation 2's layout puts on it.
    coords = assign_ranks(live.plans[2].plan)
    for node, t in live.timings[2].items():
        assert t.ranks == [rank for rank, c in enumerate(coords) if c.node == node]
    assert sum(t.reconfig.bytes_fetched for t in live.timings[2].values()) == rec["bytes_moved"]
    mine = live.timings[2][NODE].reconfig.bytes_fetched
    assert 0 < live.after["elastic_transfer_bytes_total"] == mine < rec["bytes_moved"]


def test_report_of_the_run(live: Live) -> None:
    path = write_report(live.run_dir)
    assert path == live.run_dir / "report.png" and path.stat().st_size > 0
    (rec,) = live.summary.recoveries
    text = summary_text(live.run_dir)
    assert text.startswith(f"{STEPS} steps committed") and f"final loss {live.summary.losses[-1]:.4f}" in text
    assert f"generation 2 (node 2 lost): {rec['total_s']:.2f} s, {rec['bytes_moved']} bytes moved" in text


# ---- snapshot() as a pure function: cases the live run does not reach ------------------------


def _record(nodes: list[int], pipelines: int, **kw: Any) -> GenerationRecord:
    plan = even_plan(
        num_layers=6, nodes=nodes, num_pipelines=pipelines, global_microbatches=4, microbatch_size=2
    )
    return GenerationRecord(plan=plan, resume_step=0, incarnations=dict.fromkeys(nodes, 0), **kw)


def _timings(first_commit_at: float, bytes_fetched: int, *, rank: int) -> RecoveryTimings:
    return RecoveryTimings(ranks=[rank], seen_at=0.0, reconfig=ReconfigTimings(transfer_s=0.1, rebuild_s=0.2, bytes_fetched=bytes_fetched),
                           started_at=first_commit_at - 0.5, first_commit_at=first_commit_at)


def test_snapshot_superseded_generation_and_node_bytes() -> None:
    plans = {
        1: _record([0, 1, 2, 3], 2),
        2: _record([0, 1, 3], 2, lost=[2], detected_at=10.0, published_at=10.5),
        3: _record([0, 3], 2, lost=[1], detected_at=11.0, published_at=11.2),
    }
    # Generation 2 was superseded after one of its three workers reported; generation 3 finished.
    # Records are by node: generation 3's rank 1 is node 3 (pipeline 1's only stage).
    timings = {2: {0: _timings(12.0, 100, rank=0)}, 3: {0: _timings(14.0, 10, rank=0), 3: _timings(14.5, 1000, rank=1)}}
    injected = {"kill-node2-step5": 9.0, "kill-node1-reconfig": 10.8}
    snap = snapshot(node=3, seq_len=64, window=10, plans=plans, progress=None, timings=timings, injected=injected,
                    workers=[], nodes_alive=2)
    assert snap.generation == 3 and snap.recoveries == 2 and snap.step == 0 and snap.tokens_per_s is None
    assert [r.generation for r in snap.finished] == [2, 3]
    last = snap.finished[-1]
    assert last.total_s == pytest.approx(14.5 - 10.8) and last.phases["detecting"] == pytest.approx(
        11.0 - 10.8
    )
    assert last.phases["replaying"] == pytest.approx(0.5)
    assert snap.node_bytes == 1000 and snap.job_bytes == 1110


def test_snapshot_throughput_of_one_step() -> None:
    record = ProgressRecord(step=0, loss=2.5, grad_norm=1.0, lr=1e-3, seconds=0.5, generation=1, committed_at=5.0,
                            recent=[[0, 5.0, 0.5]])
    snap = snapshot(node=0, seq_len=64, window=10, plans={1: _record([0, 1], 2)}, progress=record, timings={},
                    injected={}, workers=[], nodes_alive=2)
    assert snap.step == 1 and snap.loss == 2.5 and snap.tokens_per_s == pytest.approx(8 * 64 / 0.5)
    assert snapshot(node=0, seq_len=None, window=10, plans={1: _record([0, 1], 2)}, progress=record,
                    timings={}, injected={}, workers=[], nodes_alive=2).tokens_per_s is None


def test_snapshot_throughput_over_the_recent_window() -> None:
    recent = [[s, 10.0 + 0.5 * s, 0.4] for s in range(12, 20)]  # the record's window: 8 steps
    record = ProgressRecord(step=19, loss=2.0, grad_norm=1.0, lr=1e-3, seconds=0.4, generation=1,
                            committed_at=19.5, recent=recent)
    snap = snapshot(node=0, seq_len=64, window=4, plans={1: _record([0, 1], 2)}, progress=record, timings={},
                    injected={}, workers=[], nodes_alive=2)
    assert snap.step == 20 and snap.tokens_per_s == pytest.approx(8 * 64 * 3 / 1.5)
    wide = snapshot(node=0, seq_len=64, window=10, plans={1: _record([0, 1], 2)}, progress=record, timings={},
                    injected={}, workers=[], nodes_alive=2)
    assert wide.tokens_per_s == pytest.approx(8 * 64 * 7 / 3.5)  # capped at the record's 8 steps
