"""Stragglers found on a live run (real etcd, agents, workers; issue 33, policy `report`): node 3
of 4 (2 two-stage pipelines, 4 microbatches each) is throttled at half speed with real
SIGSTOP/SIGCONT (`elastic inject slow --factor 2`) for 10 s mid-run. The reporter marks node 3,
and only node 3, while it is slow; `status` shows the mark while it lasts; the mark clears after
the release; `events` has both; and the plan is untouched (one generation). The detector's
thresholds on recorded series of this machine, noise and slowdowns: tests/planning/test_stragglers.py."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from elastic.coordinator import EtcdServer
from elastic.coordinator.events import read_events
from elastic.ops.status import read_status, render_table
from elastic.records.stragglers import read_stragglers

from .runs import LiveJob, tiny_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

STEPS = 2000
"""An upper bound: the test stops the job once the mark has come and gone."""
SLOW_NODE = 3
SLOW_AT = 10
"""Committed steps before the throttle starts."""
SLOW_S = 10.0
"""At least 20 slowed steps even where a step takes 0.25 s (0.1 s on an idle 2-core machine)."""


def _marks(job: LiveJob) -> list[dict[str, Any]]:
    return [e for e in read_events(job.client, job.keys) if e["kind"] in ("straggler", "straggler-cleared")]


def _wait_for(what: str, check: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"{what} within {timeout} s")


class Outcome:
    def __init__(self, job: LiveJob, code: int, output: str, shown: str, slow_at: float) -> None:
        self.code, self.output, self.shown, self.slow_at = code, output, shown, slow_at
        self.marks = _marks(job)
        self.record = read_stragglers(job.client, job.keys)
        self.generations = sorted(int(m.key.decode().rsplit("/", 1)[1])
                                  for _, m in job.client.get_prefix(job.keys.plans, keys_only=True))


@pytest.fixture(scope="module")
def outcome(etcd_server: EtcdServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Outcome]:
    config = tiny_config(tmp_path_factory.mktemp("stragglers"), nodes=4, pipelines=2, steps=STEPS,
                         global_microbatches=8)
    job = LiveJob(config, etcd=etcd_server.endpoint, timeout_s=200.0).start()
    try:
        job.wait_committed(SLOW_AT)
        slow_at = time.time()
        code, output = job.cli("inject", "slow", "--node", str(SLOW_NODE), "--factor", "2",
                               "--seconds", str(SLOW_S), "--wait", "0")
        # `status` while the node is slow: the mark, once the reporter has set it.
        shown = _wait_for("status showing a straggler", lambda: next(
            (render_table(st) for st in [read_status(job.client, job.keys, etcd=job.etcd)]
             if any(n.straggler is not None for n in st.nodes)), None), SLOW_S + 30)
        _wait_for("the mark cleared", lambda: any(e["kind"] == "straggler-cleared" for e in _marks(job)), 60)
        yield Outcome(job, code, output, shown, slow_at)
    finally:
        job.close()


def test_the_slow_node_is_marked_while_slow_and_cleared_after(outcome: Outcome) -> None:
    assert outcome.code == 0, outcome.output
    print("\n".join(f"{e['kind']}: node {e['node']} step {e['step']} factor {e['factor']}: {e['reason']}"
                    for e in outcome.marks))
    assert [(e["kind"], e["node"]) for e in outcome.marks] == [("straggler", SLOW_NODE),
                                                               ("straggler-cleared", SLOW_NODE)]
    marked, cleared = outcome.marks
    assert outcome.slow_at < marked["time"] < outcome.slow_at + SLOW_S + 1.0, "marked while the node was slow"
    assert marked["factor"] >= 1.25 and cleared["time"] > outcome.slow_at + SLOW_S
    assert cleared["factor"] < 1.125
    # `status` showed the mark and every node's factor while it lasted.
    print(outcome.shown)
    assert f"stragglers: node {SLOW_NODE} (" in outcome.shown, outcome.shown
    header = [line for line in outcome.shown.splitlines() if line.lstrip().startswith("node  alive")]
    assert header and "speed" in header[0], outcome.shown
    record = outcome.record
    assert record is not None and record.policy == "report" and sorted(record.factors) == [0, 1, 2, 3], record
    # Report only: the plan is untouched.
    assert outcome.generations == [1]
