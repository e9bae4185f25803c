"""A whole node crashes: its agent and its workers SIGKILLed at once, mid-step.

3 nodes, a 2-stage pipeline (nodes 0, 1) and a 1-stage one (node 2). At step 8 the test
SIGKILLs node 1's agent and worker together (PIDs from etcd's `workers/1/` and the agent's
command line): nobody is left to report the failure, so only the lease expiry reveals it, and
the leader's probe of the suspect, refused at once, confirms it. The survivors stay up (same
PIDs), the leader re-plans onto nodes 0 and 2, node 0 fetches the layers it now needs from node
2, and the run ends where the failure-free run ends (losses and final parameters within 1e-5,
every step committed once).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass

import psutil
import pytest

from elastic.coordinator import EtcdServer
from elastic.records.node_workers import read_registrations

from .runs import LiveJob, Result, agent_pid, check_same_training, reference_run, tiny_config

STEPS = 20
KILL_AT = 8
VICTIM = 1

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@dataclass
class Outcome:
    reference: Result
    result: Result
    victim_pids: list[int]
    failure_reports: list[dict[str, object]]


@pytest.fixture(scope="module")
def outcome(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Outcome]:
    root = tmp_path_factory.mktemp("node-crash")
    reference = reference_run(tmp_path_factory, steps=STEPS)
    server = EtcdServer(data_dir=root / "etcd").start()
    run = LiveJob(tiny_config(root / "run", nodes=3, pipelines=2, steps=STEPS), etcd=server.endpoint, job="crash",
                  token="crash-token")
    victims: list[int] = []
    try:
        run.start()
        run.wait_committed(KILL_AT - 1, 120.0)
        workers = [info.pid for info in read_registrations(run.client, run.rk, node=VICTIM).values()]
        victims = [agent_pid(run.job, VICTIM), *workers]
        for pid in victims:  # all at once: no process of the node survives to report anything
            # The agent first, so that it cannot see its worker die and report it. A worker dies
            # with its agent (PR_SET_PDEATHSIG) and may be reaped before its own kill lands.
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        result = run.result()
        reports = [json.loads(value) for value, _ in run.client.get_prefix(run.keys.failed)]
        yield Outcome(reference, result, victims, reports)
    finally:
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        run.close()
        server.close()


def test_survivors_recover_to_the_failure_free_result(outcome: Outcome) -> None:
    summary, state = outcome.result
    check_same_training(summary, state, outcome.reference)
    (rec,) = summary.recoveries
    assert rec["lost_nodes"] == [VICTIM] and rec["restore_checkpoint"] is None
    assert rec["bytes_moved"] > 0, "node 0 must fetch the layers node 1 held"
    for key, pids in summary.worker_pids.items():
        node = int(key.split("/")[0])
        if node != VICTIM:
            assert key.endswith("/0") and len(pids) == 1, (key, pids)


def test_the_loss_was_found_by_lease_expiry(outcome: Outcome) -> None:
    # Nobody of node 1 was left to revoke its lease or report its failure: etcd's expiry made it
    # a suspect, and the leader's probe, refused, recorded it failed (elastic/roles/leader_suspects.py).
    assert outcome.failure_reports and all("no answer to the probe" in str(r["reason"])
                                           for r in outcome.failure_reports), outcome.failure_reports
    assert len(outcome.victim_pids) == 2
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                   for p in outcome.victim_pids)
