"""Three of four nodes SIGKILLed at once: the guard hides no real mass loss (issue 56).

4 nodes (two 2-stage pipelines, f = 1, no checkpoints, 40 steps, lease TTL 3 s) on their own
etcd, which stays healthy. Once step 10 is committed the test SIGKILLs three nodes whole (agents
first, then workers, PIDs read beforehand): nothing is left on them to report the crash, so
their leases expire, within the TTL, together. That is mass suspicion (more than half the nodes
at once), the pattern of an etcd stall: the leader probes the suspects, twice, and every probe
is refused at once (nothing listens on a dead agent's port). So the three are lost, as they
were before the guard, and with them every holder of some layers: with no checkpoint the job
stops with today's error ("... have no live holder and no complete checkpoint ...").

Two cases: the leader's node survives, or it is one of the three (the survivor then takes
office when the election's lease expires). "Today's time" (before the guard) is the lease expiry
(at most the TTL after the kill, plus etcd's half-second expiry sweep) and one leader round, or,
with the leader killed, the election's expiry and the new leader's first round: the issue allows
the probe's deadline + 3 s on top of it, so kill -> the leader gave up must take at most
TTL + PROBE_DEADLINE_S + 3 s. bench/detection.py measures the same case before and after the
guard, side by side (bench/README.md).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from elastic.coordinator import EtcdServer
from elastic.coordinator.election import current_leader
from elastic.coordinator.events import read_events
from elastic.coordinator.probe import PROBE_DEADLINE_S
from elastic.records.node_workers import read_registrations
from elastic.records.suspicion import LOST, STALL
from elastic.records.workers import node_of
from elastic.roles.launch_errors import JobFailed

from .runs import LiveJob, agent_pid, tiny_config

STEPS = 40
KILL_AT = 10
NODES = 4
TTL_S = 3
STOP_WITHIN_S = TTL_S + PROBE_DEADLINE_S + 3.0
"""Kill -> the leader gives up: today's time (TTL, etcd's sweep, a round) + the probe's deadline + 3 s."""
ERROR = r"the leader gave up: .*shards \[.*\] have no live holder and no complete checkpoint exists"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@dataclass
class Outcome:
    victims: set[int]
    survivor: int
    killed_at: float
    error: BaseException | None
    ended_at: float
    """When the launcher's run ended (wall time)."""
    events: list[dict[str, Any]]
    committed: int


def _kill_nodes(run: LiveJob, nodes: list[int]) -> float:
    """SIGKILL every process of `nodes` at once (all agents first: none may see a worker die and
    report it); the wall time just before the first signal."""
    agents = [agent_pid(run.job, n) for n in nodes]
    workers = [info.pid for n in nodes for info in read_registrations(run.client, run.rk, node=n).values()]
    killed_at = time.time()
    for pid in [*agents, *workers]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return killed_at


@pytest.fixture(scope="module", params=["leader-survives", "leader-killed"])
def outcome(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Outcome]:
    root = tmp_path_factory.mktemp(f"mass-loss-{request.param}")
    server = EtcdServer(data_dir=root / "etcd").start()
    config = tiny_config(root / "run", nodes=NODES, pipelines=2, steps=STEPS, checkpoint_every=0, lease_ttl=TTL_S)
    run = LiveJob(config, etcd=server.endpoint, job=f"mass-loss-{request.param}", timeout_s=200.0)
    try:
        run.start()
        run.wait_committed(KILL_AT, 120.0)
        leader = current_leader(run.client, run.keys)
        assert leader is not None
        leads = node_of(leader)
        survivor = leads if request.param == "leader-survives" else (leads + 1) % NODES
        victims = [n for n in range(NODES) if n != survivor]
        killed_at = _kill_nodes(run, victims)
        error: BaseException | None = None
        try:
            run.result()
        except BaseException as exc:  # noqa: BLE001 - the failure is what the tests look at
            error = exc
        ended_at = time.time()
        yield Outcome(set(victims), survivor, killed_at, error, ended_at, read_events(run.client, run.keys),
                      run.committed())
    finally:
        run.close()  # the launcher stops what it started by PID; the victims are dead already
        server.stop()


def test_the_job_stops_with_todays_error_in_time(outcome: Outcome) -> None:
    assert isinstance(outcome.error, JobFailed), outcome.error
    assert re.search(ERROR, str(outcome.error)), str(outcome.error)
    (fatal,) = [e for e in outcome.events if e["kind"] == "fatal"]
    stopped = float(fatal["time"]) - outcome.killed_at
    print(f"nodes {sorted(outcome.victims)} SIGKILLed (node {outcome.survivor} left): the leader gave up "
          f"{stopped:.2f} s later, the run ended {outcome.ended_at - outcome.killed_at:.2f} s later")
    assert 0.0 < stopped <= STOP_WITHIN_S, fatal
    assert outcome.committed < STEPS


def _nodes(value: object) -> set[int]:
    assert isinstance(value, list), value
    return {int(n) for n in value}


def test_every_killed_node_was_probed_and_found_silent(outcome: Outcome) -> None:
    verdicts = [e for e in outcome.events if e["kind"] == "suspects" and e.get("nodes")]
    assert verdicts, [e["kind"] for e in outcome.events]
    silent = set().union(*(_nodes(e["silent"]) for e in verdicts))
    answered = set().union(*(_nodes(e["answered"]) for e in verdicts))
    assert silent == outcome.victims, verdicts
    assert not answered & outcome.victims, verdicts  # a dead agent never vouches for itself
    assert all(e["decision"] == LOST for e in verdicts if _nodes(e["silent"])), verdicts
    assert not any(e["decision"] == STALL for e in verdicts), verdicts
