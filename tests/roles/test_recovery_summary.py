"""A superseded generation's recovery records folded into one key (elastic/roles/recovery_summary.py),
against a real etcd: the node keys go and the summary reads as they did for every reader (the
breakdown, the workers counted, each node's bytes in the metrics, the launcher's watch); a late
node record is folded in by the next fold; records that cannot be folded are left as they are."""

from __future__ import annotations

import random
from typing import Any

import pytest

from elastic.coordinator.events import record_event
from elastic.coordinator.generations import Generations
from elastic.coordinator.keys import JobKeys, RunKeys
from elastic.ops.events import History
from elastic.ops.metrics_snapshot import snapshot
from elastic.records.generation import GenerationRecord
from elastic.records.recoveries import breakdown_of
from elastic.records.recovery_timings import SUMMARY_NODE, ReconfigTimings, RecoveryTimings, workers_reported
from elastic.roles.etcd_writes import write_batch
from elastic.roles.launcher_feed import JobFeed, Progress, _take
from elastic.roles.recovery_summary import fold_generation
from templates.plan import even_plan
from tests.polling import wait_for

pytestmark = pytest.mark.timeout(60)

T0 = 1_790_000_000.0
NODES = [0, 1, 2, 3, 5, 6]
GPUS = 2


def _records(seed: int) -> dict[int, RecoveryTimings]:
    """Node -> its workers' folded record (node 3's workers fetched nothing)."""
    rng = random.Random(seed)
    out = {}
    for i, node in enumerate(NODES):
        out[node] = RecoveryTimings(
            ranks=[GPUS * i + lr for lr in range(GPUS)], seen_at=T0 + rng.uniform(0, 0.2),
            reconfig=ReconfigTimings(transfer_s=rng.uniform(0, 2), rebuild_s=rng.uniform(0, 1),
                                     bytes_fetched=0 if node == 3 else rng.randrange(1, 10**9),
                                     bytes_collective=rng.randrange(10**6)),
            started_at=T0 + rng.uniform(1, 3), first_commit_at=T0 + rng.uniform(3, 5))
    return out


def _write(client: Any, rk: RunKeys, g: int, records: dict[int, RecoveryTimings]) -> None:
    for node, rec in records.items():
        write_batch(client, [], [(rk.recovery(g, node), rec)], {})


def _read(client: Any, rk: RunKeys, g: int) -> dict[str, RecoveryTimings]:
    prefix = rk.prefix("recoveries", g)
    return {meta.key.decode()[len(prefix):]: RecoveryTimings.from_json(v) for v, meta in client.get_prefix(prefix)}


def _generation(g: int) -> GenerationRecord:
    plan = even_plan(num_layers=6, nodes=NODES, num_pipelines=2, global_microbatches=4, microbatch_size=1,
                     gpus_per_node=GPUS)
    return GenerationRecord(plan=plan, resume_step=g, incarnations=dict.fromkeys(NODES, 0), lost=[4],
                            detected_at=T0 - 1, synced_at=T0 - 0.8, published_at=T0 - 0.5)


def _node_bytes(g: int, node: int, records: dict[str, RecoveryTimings]) -> tuple[int, int]:
    """(this node's, the job's) transfer bytes as the metrics count them from `records` of g."""
    timings = {g: {SUMMARY_NODE if k == "all" else int(k): r for k, r in records.items()}}
    snap = snapshot(node=node, seq_len=None, window=10, plans={1: _generation(1), g: _generation(g)}, progress=None,
                    timings=timings, injected={}, workers=[], nodes_alive=len(NODES))
    return snap.node_bytes, snap.job_bytes


def test_a_generations_node_records_fold_into_one_key_read_as_they_were(client: Any, job: str) -> None:
    rk, g = RunKeys(JobKeys(job)), 3
    records = _records(1)
    _write(client, rk, g, records)
    _write(client, rk, g + 1, _records(2))  # a later generation's records are not touched
    before = _read(client, rk, g)
    assert sorted(before) == [str(n) for n in NODES]
    carried = [("kill-node4-step3", T0 - 1.5)]
    bytes_before = {n: _node_bytes(g, n, before) for n in NODES}

    assert fold_generation(client, rk, g) == len(NODES)
    after = _read(client, rk, g)
    assert list(after) == ["all"]
    summary = after["all"]
    assert breakdown_of(g, _generation(g), [summary], carried) == breakdown_of(g, _generation(g), list(before.values()), carried)
    assert workers_reported([summary]) == GPUS * len(NODES) and summary.ranks == list(range(GPUS * len(NODES)))
    assert summary.node_bytes == {n: r.reconfig.bytes_fetched for n, r in records.items() if n != 3}
    assert {n: _node_bytes(g, n, after) for n in NODES} == bytes_before, "a node's transfer counter must not drop"
    assert sorted(_read(client, rk, g + 1)) == [str(n) for n in NODES]
    assert fold_generation(client, rk, g) == 0 and _read(client, rk, g) == after  # nothing left to fold

    # A late node record (a writer whose key was folded away) stands beside the summary, is
    # counted once by every reader, and the next fold takes it in.
    late = RecoveryTimings(ranks=[100, 101], seen_at=T0, started_at=T0 + 1, first_commit_at=T0 + 6,
                           reconfig=ReconfigTimings(transfer_s=3.0, rebuild_s=0.1, bytes_fetched=77))
    write_batch(client, [], [(rk.recovery(g, 7), late)], {})
    beside = _read(client, rk, g)
    assert workers_reported(list(beside.values())) == GPUS * len(NODES) + 2
    assert _node_bytes(g, 7, beside) == (77, bytes_before[0][1] + 77)
    assert fold_generation(client, rk, g) == 1
    refolded = _read(client, rk, g)
    assert list(refolded) == ["all"] and refolded["all"].node_bytes[7] == 77
    assert breakdown_of(g, _generation(g), [refolded["all"]], carried) == \
        breakdown_of(g, _generation(g), list(beside.values()), carried)


def test_records_that_cannot_be_folded_are_left_as_they_are(client: Any, job: str) -> None:
    rk = RunKeys(JobKeys(job))
    records = _records(3)
    _write(client, rk, 2, records)
    client.put(rk.recovery(2, 9), b"{not json")
    assert fold_generation(client, rk, 2) == 0
    assert len(list(client.get_prefix(rk.prefix("recoveries", 2)))) == len(NODES) + 1
    # two records that hold some of the same ranks: the fold is refused, not guessed
    _write(client, rk, 5, records)
    overlap = RecoveryTimings(ranks=[0, 50], seen_at=T0, started_at=T0, first_commit_at=T0,
                              reconfig=ReconfigTimings(transfer_s=0.0, rebuild_s=0.0, bytes_fetched=1))
    client.put(rk.recovery(5, 8), overlap.to_json())
    assert fold_generation(client, rk, 5) == 0
    assert sorted(_read(client, rk, 5)) == sorted([*map(str, NODES), "8"])


def test_the_launchers_watch_ends_with_the_summary_alone(client: Any, job: str) -> None:
    """The launcher's feed sees the node records, then the summary put and their deletes: it
    keeps the summary only (its memory of a generation does not grow with nodes)."""
    rk, g = RunKeys(JobKeys(job)), 2
    feed = JobFeed(client, rk)
    try:
        records = _records(4)
        _write(client, rk, g, records)
        progress = Progress()
        lines: list[str] = []

        def took() -> bool:
            for ev in feed.drain():
                _take(ev, rk, progress, lines.append, None)  # type: ignore[arg-type]  # no step lines here
            return progress.timings.get(g, {}).keys() == {str(n) for n in NODES}

        wait_for(took, 10.0, "the node records through the launcher's watch")
        fold_generation(client, rk, g)

        def summary_alone() -> bool:
            took()
            return list(progress.timings.get(g, {})) == ["all"]

        wait_for(summary_alone, 10.0, "the summary alone in the launcher's view")
        assert workers_reported(list(progress.timings[g].values())) == GPUS * len(NODES)
        assert progress.timings[g]["all"].reconfig.bytes_fetched == sum(r.reconfig.bytes_fetched for r in records.values())
    finally:
        feed.close()


def test_elastic_events_shows_a_folded_recovery_where_and_as_it_was(client: Any, job: str) -> None:
    """`elastic events` orders a recovery by the revision of its generation's last record: the fold,
    written later, moves it nowhere, and its figures are the same."""
    keys = JobKeys(job)
    rk, gens = RunKeys(keys), Generations(client, keys)
    gens.publish(_generation(1).to_json(), expected=0)
    gens.publish(_generation(2).to_json(), expected=1)
    _write(client, rk, 2, _records(5))
    record_event(client, keys, who="test", kind="note", reason="after the recovery")
    before = [e for e in History(client, keys).read_all() if e.kind in ("recovered", "note")]
    assert [e.kind for e in before] == ["recovered", "note"]
    assert fold_generation(client, rk, 2) == len(NODES)
    after = [e for e in History(client, keys).read_all() if e.kind in ("recovered", "note")]
    assert after == before
