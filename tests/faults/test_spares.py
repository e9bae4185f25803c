"""Hot spares on real processes (etcd, agents, workers, a real SIGKILL): `elastic run --spares 1`.

One run of tiny on 4 nodes in two 2-stage pipelines with one spare (node 4): node 1 is
SIGKILLed at step 8 and restarted at step 10. The re-plan that drops node 1 takes node 4 in (the
same generation, no degraded plan in between), the plan after it has as many pipelines of the
same templates as before, and the restarted node 1 comes back as a spare (`elastic status --json`)
and is not taken in for the loss. Then `elastic drain --node 3`: the drain's re-plan takes the
spare (node 1, incarnation 1) in for node 3, on node 3's stage. The final state equals the
failure-free run at 1e-5.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import time
from typing import Any

import pytest

from elastic.coordinator import EtcdServer
from elastic.coordinator.events import read_events
from elastic.records.generation import GenerationRecord
from elastic.records.injection import parse_injection
from elastic.records.injection_requests import InjectionRequest, request_id, submit_request
from tests.polling import wait_for

from .runs import LiveJob, check_same_training, reference_run, tiny_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

STEPS = 40
"""Steps, as many as the shared failure-free run of test_etcd_cluster and others: the restarted
node (a warm fork, about a second) and the drain are done by step 20 on an idle machine, and the
slowed steps after step 12 keep the job going for 8 s more on a loaded one."""
INJECT = ("kill:node=1,step=8", "rejoin:node=1,step=10")
DRAINED = 3
"""The node drained once the restarted node 1 is a spare (a second stage, as node 1 was)."""


def _slow_node0(job: LiveJob) -> None:
    """Node 0's workers run a quarter of the time for 8 s from step 12 (`elastic inject slow`):
    the job outlasts the restarted node's start and the drain after it even on a loaded machine
    (a slow node changes no result)."""
    req = InjectionRequest(id=request_id("slow", 0, 12), kind="slow", node=0, incarnation=0, when="step", step=12,
                           seconds=8.0, factor=4.0, requested_at=time.time(), by="test_spares")
    submit_request(job.client, job.keys.root, req)


def _status(job: LiveJob, *flags: str) -> str:
    """`elastic status FLAGS` of the live job, run in this process: its output."""
    from elastic.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["status", *flags, "--etcd", job.etcd, "--job", job.job])
    assert code == 0, out.getvalue()
    return out.getvalue()


def _generations(job: LiveJob) -> dict[int, GenerationRecord]:
    return {int(meta.key.decode().rsplit("/", 1)[-1]): GenerationRecord.from_json(value)
            for value, meta in job.client.get_prefix(job.keys.plans)}


@pytest.fixture(scope="module")
def spare_run(tmp_path_factory: pytest.TempPathFactory, etcd_server: EtcdServer) -> dict[str, Any]:
    config = tiny_config(tmp_path_factory.mktemp("spares"), nodes=4, pipelines=2, steps=STEPS)
    config = dataclasses.replace(config, spares=1, injections=tuple(parse_injection(i) for i in INJECT))
    job = LiveJob(config, etcd=etcd_server.endpoint, timeout_s=360.0).start()
    try:
        job.wait_committed(1)
        _slow_node0(job)
        first = None
        returned = None
        text = ""
        deadline = time.monotonic() + 300.0
        while returned is None and job.error is None and time.monotonic() < deadline:
            status = json.loads(_status(job, "--json"))
            if first is None and status["generation"] == 1:
                first = status
            roles = {(n["node"], n["incarnation"]): n["role"] for n in status["nodes"]}
            if roles.get((1, 1)) == "spare":
                returned = status
                text = _status(job)
            time.sleep(0.2)
        code, out = -1, "the restarted node 1 never came back as a spare: no drain"
        if returned is not None:
            wait_for(lambda: _is_spare(job, node=1, incarnation=1), 60.0, "the leader to keep node 1 as a spare")
            assert job.generation() == 2, f"generation {job.generation()} before the drain"
            code, out = job.cli("drain", "--node", str(DRAINED), "--wait", "60")
        summary, state = job.result()
        return {"summary": summary, "state": state, "first": first, "returned": returned, "text": text,
                "drain_code": code, "drain_out": out,
                "generations": _generations(job), "events": read_events(job.client, job.keys)}
    finally:
        job.close()


def _is_spare(job: LiveJob, *, node: int, incarnation: int) -> bool:
    """The leader recorded this incarnation of `node` as a hot spare (ready to be taken in)."""
    return any(e["kind"] == "spare" and (e["node"], e["incarnation"]) == (node, incarnation)
               for e in read_events(job.client, job.keys))


def test_a_spare_replaces_the_killed_node_in_the_same_replan(spare_run: dict[str, Any]) -> None:
    gens: dict[int, GenerationRecord] = spare_run["generations"]
    # One re-plan for the loss (the loss and the spare's entry are the same generation), one for the drain.
    assert sorted(gens) == [1, 2, 3], "one re-plan for the loss, one for the drain"
    assert gens[3].drained == [DRAINED] and gens[3].lost == []
    before, after = gens[1].plan, gens[2].plan
    assert gens[2].lost == [1] and gens[2].joined == [4]
    assert sorted(after.nodes) == [0, 2, 3, 4]
    assert len(after.pipelines) == len(before.pipelines) == 2
    assert sorted(len(p.stages) for p in after.pipelines) == sorted(len(p.stages) for p in before.pipelines)
    assert gens[2].restore_checkpoint is None, "the spare fetched the lost node's shards from replicas"
    (rec,) = [r for r in spare_run["summary"].recoveries if r["lost_nodes"]]
    assert rec["lost_nodes"] == [1] and rec["joined_nodes"] == [4] and rec["bytes_moved"] > 0


def test_the_run_equals_the_failure_free_run(
    spare_run: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    check_same_training(spare_run["summary"], spare_run["state"], reference_run(tmp_path_factory, steps=STEPS),
                        steps=STEPS)


def test_status_shows_the_spares(spare_run: dict[str, Any]) -> None:
    first = spare_run["first"]
    if first is not None:  # read before the kill (the run may pass step 8 before the first read)
        assert first["spares"] == [4]
        assert {n["node"]: n["role"] for n in first["nodes"]} == {0: "active", 1: "active", 2: "active",
                                                                   3: "active", 4: "spare"}
    returned = spare_run["returned"]
    assert returned is not None, "the restarted node 1 never showed as a spare in elastic status --json"
    assert returned["spares"] == [1]
    roles = {n["node"]: (n["role"], n["incarnation"]) for n in returned["nodes"]}
    assert roles[1] == ("spare", 1) and roles[4] == ("active", 0)
    assert "hot spares: node 1 (incarnation 1)" in spare_run["text"], spare_run["text"]


def test_events_name_the_spares(spare_run: dict[str, Any]) -> None:
    events = spare_run["events"]
    spares = {(e["node"], e["incarnation"]) for e in events if e["kind"] == "spare"}
    assert {(4, 0), (1, 1)} <= spares
    taken = [e for e in events if e["kind"] == "spare-taken"]
    assert [(e["node"], e["incarnation"], e["lost"], e.get("drained"), e["generation"]) for e in taken] == [
        (4, 0, [1], None, 2), (1, 1, [], [DRAINED], 3)]


def test_a_drained_node_is_replaced_by_the_spare(spare_run: dict[str, Any]) -> None:
    """The restarted node 1, a spare since, takes drained node 3's stage (the run's equality with
    the failure-free run: test_the_run_equals_the_failure_free_run)."""
    assert spare_run["drain_code"] == 0, spare_run["drain_out"]
    gens: dict[int, GenerationRecord] = spare_run["generations"]
    assert sorted(gens) == [1, 2, 3]
    assert gens[3].drained == [DRAINED] and gens[3].joined == [1] and gens[3].lost == []
    assert gens[3].incarnations[1] == 1, "the restarted incarnation of node 1 was taken in"
    before, after = gens[2].plan, gens[3].plan
    assert [[(1 if st.node == DRAINED else st.node, st.layers) for st in p.stages] for p in before.pipelines] == \
        [[(st.node, st.layers) for st in p.stages] for p in after.pipelines], "the spare took the drained node's stage"
