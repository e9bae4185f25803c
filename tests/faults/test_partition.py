"""One live run: `elastic inject partition` cuts node 2 off for 7 s (lease TTL 3 s), emulated by
its agent (keepalives stop, workers SIGSTOPped). The survivors re-plan without it and train on;
the healed node finds itself fenced, kills its workers before they run again and leaves
(EXIT_FENCED) without writing anything into the job. The launcher (`rejoin_fenced=1`, `elastic run
--rejoin-fenced 1`) starts its next incarnation, which joins at a step boundary like a new node;
the final state equals the failure-free run.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic.coordinator import EtcdServer
from elastic.coordinator.events import read_events
from elastic.coordinator.generations import Generations
from elastic.records.generation import GenerationRecord
from elastic.records.injection_requests import read_requests, read_statuses
from elastic.records.summary import RunSummary

from .runs import LiveJob, check_same_training, reference_run, step_logs, tiny_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

STEPS = 100
"""Enough for the survivors to train on past the heal and the rejoin (about 10 s after the cut)."""
PARTITION_S = 7.0


@pytest.fixture(scope="module")
def run(etcd_server: EtcdServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    config = tiny_config(tmp_path_factory.mktemp("partition"), nodes=4, pipelines=2, steps=STEPS)
    job = LiveJob(config, etcd=etcd_server.endpoint, timeout_s=200.0, rejoin_fenced=1).start()
    try:
        job.wait_committed(3)
        code, output = job.cli(
            "inject", "partition", "--node", "2", "--seconds", str(PARTITION_S), "--wait", "60"
        )
        summary, state = job.result()
        client, keys = job.client, job.keys
        (rid,) = [r.id for r in read_requests(client, keys.root) if r.kind == "partition"]
        gens = Generations(client, keys)
        records = {g: GenerationRecord.from_json(gens.get(g).plan)  # type: ignore[union-attr]
                   for g in range(1, gens.current_number() + 1)}
        revisions = {g: gens.get(g).revision for g in records}  # type: ignore[union-attr]
        rk = job.rk
        old_keys = [(m.key.decode(), m.mod_revision) for prefix in (rk.sync(1), rk.prefix("ready", 1), rk.prefix("decisions", 1))
                    for _, m in client.get_prefix(prefix)]
        yield {
            "code": code, "output": output, "summary": summary, "state": state,
            "status": read_statuses(client, keys.root)[rid], "events": read_events(client, keys),
            "records": records, "revisions": revisions, "old_keys": old_keys, "progress": job.progress_seen(),
            "logs": step_logs(Path(config.spec.run_dir)),
        }
    finally:
        job.close()


def test_partitioned_node_is_fenced_and_the_job_trains_on(run: dict[str, Any], tmp_path_factory: Any) -> None:
    print(run["output"])
    assert run["code"] == 0, run["output"]
    status = run["status"]
    assert status.state == "fenced" and status.generation >= 2, status
    records = run["records"]
    assert records[2].lost == [2] and 2 not in records[2].plan.nodes
    assert [e for e in run["events"] if e["kind"] == "fenced" and e["who"] == "node2"], "no fenced event"
    # it came back once, as its next incarnation, through a join (never as the fenced one)
    (back,) = [g for g, r in records.items() if r.joined]
    assert records[back].joined == [2] and records[back].incarnations[2] == 1, records[back]
    assert all(2 not in r.plan.nodes for g, r in records.items() if 2 <= g < back)
    assert all(r.incarnations.get(2, 1) == 1 for g, r in records.items() if g >= 2)
    (rejoin,) = [e for e in run["events"] if e["kind"] == "fenced-rejoin"]
    assert (rejoin["node"], rejoin["fenced"], rejoin["incarnation"]) == (2, 0, 1), rejoin
    reference: tuple[RunSummary, dict[str, torch.Tensor]] = reference_run(tmp_path_factory, steps=STEPS)
    check_same_training(run["summary"], run["state"], reference, steps=STEPS)


def test_healed_node_wrote_nothing_after_its_fencing(run: dict[str, Any]) -> None:
    # Generation 2 is the fencing: from its publication on, nothing may be written under
    # generation 1 (sync reports, ready marks, decisions) and no step may be committed by
    # generation 1: no progress record of generation 1 (a watch saw every put of the key), and
    # no step of generation 1 at or past generation 2's resume step in any worker's local log
    # (the healed node's included).
    fenced_at = run["revisions"][2]
    late = [key for key, rev in run["old_keys"] if rev > fenced_at]
    assert late == [], f"written under generation 1 after generation 2 was published: {late}"
    assert run["progress"], "the watch saw no progress record"
    late_results = [r.step for r, rev in run["progress"] if r.generation == 1 and rev > fenced_at]
    assert late_results == [], late_results
    resume = run["records"][2].resume_step
    late_logged = {name: [r.step for r in results if r.generation == 1 and r.step >= resume]
                   for name, results in run["logs"].items()}
    assert all(not steps for steps in late_logged.values()), late_logged
