"""World rank 0's StragglerReporter against a real etcd: a node twice as slow as its stage peer
is marked, then cleared when it recovers, and each `straggler` / `straggler-cleared` event is
written after the `stragglers` record that carries it. Whoever reads the record on seeing an
event (`elastic stragglers` after `elastic events`) finds the mark: the record is read at the
event's own etcd revision, so the order is checked, not raced."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from elastic.coordinator import JobKeys
from elastic.parallel.phase_clock import StepPhases
from elastic.planning.stragglers import StragglerConfig
from elastic.records.stragglers import StragglerRecord, stragglers_key
from elastic.roles.straggler_reporter import StragglerReporter
from tests.engine.plans import two_by_two

SLOW = 1
"""Node 1 holds stage 0's layers of pipeline 0; node 3 the same layers of pipeline 1."""


def _phases(slow: bool) -> dict[int, StepPhases]:
    return {n: StepPhases(forward=0.02 if slow and n == SLOW else 0.01, backward=0.01) for n in range(4)}


@pytest.mark.timeout(30)
def test_each_event_follows_the_record_that_carries_its_mark(client: Any, job: str) -> None:
    keys = JobKeys(job)
    plan = two_by_two()
    reporter = StragglerReporter(client, keys, StragglerConfig(policy="report"), who="rank-0")
    for step in range(60):
        reporter.observe(step=step, generation=1, phases=_phases(slow=step < 30), plan=plan)
        time.sleep(0.01)  # steps as they come: the mark and the clear are in different writes
    reporter.close()

    events = [(value, meta) for value, meta in client.get_prefix(keys.events, sort_order="ascend")]
    kinds = [json.loads(value)["kind"] for value, _ in events]
    assert kinds == ["straggler", "straggler-cleared"], kinds
    for (value, meta), marked in zip(events, (True, False), strict=True):
        at_event, _ = client.get(stragglers_key(keys), revision=int(meta.mod_revision))
        assert at_event is not None, "the record was not written before the event"
        record = StragglerRecord.from_json(at_event)
        assert (SLOW in record.marked) is marked, (value, record.marked)
        assert set(record.marked) <= {SLOW}
