"""Straggler traces: `slow` and `recover` events, their checks, the spec keys and JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from elastic.sim.trace import (
    MEMBERSHIP,
    Trace,
    TraceError,
    TraceEvent,
    load_trace,
    trace_from_json,
    trace_from_spec,
)

pytestmark = pytest.mark.timeout(60)

# What `trace_from_spec("every=10m,min=2,rejoin=15m,seed=3", initial_nodes=6, horizon_s=3600)` gave
# before slow events existed (commit b0ca521), as (time, event, node).
BEFORE = [(600.0, "fail", 1), (1200.0, "fail", 5), (1500.0, "join", 1), (1800.0, "fail", 4), (2100.0, "join", 5),
          (2400.0, "fail", 1), (2700.0, "join", 4), (3000.0, "fail", 3), (3300.0, "join", 1), (3600.0, "fail", 5)]


def test_a_spec_without_slow_keys_gives_the_same_events_as_before() -> None:
    trace = trace_from_spec("every=10m,min=2,rejoin=15m,seed=3", initial_nodes=6, horizon_s=3600)
    assert [(ev.time_s, ev.event, ev.node) for ev in trace.events] == BEFORE
    assert trace.slowdowns == 0
    assert all(set(d) == {"time_s", "event", "node"} for d in trace.to_list())


@pytest.mark.parametrize("base", ["every=10m,min=2,rejoin=15m,seed=3", "every=7m,min=3,seed=9,start=1m"])
def test_slow_keys_leave_the_failures_and_joins_alone(base: str) -> None:
    plain = trace_from_spec(base, initial_nodes=6, horizon_s=3600)
    slow = trace_from_spec(f"{base},slow_every=7m,slow_for=20m,slow_factor=1.5", initial_nodes=6, horizon_s=3600)
    assert [ev for ev in slow.events if ev.event in MEMBERSHIP] == list(plain.events)
    assert slow.live_counts() == plain.live_counts()
    assert slow.slowdowns == 3600 // 420 and {ev.factor for ev in slow.events if ev.event == "slow"} == {1.5}


def test_slow_spec_alone_slows_one_node_at_a_time_with_the_defaults() -> None:
    trace = trace_from_spec("slow_every=1h", initial_nodes=4, horizon_s=4 * 3600)
    slow = [ev for ev in trace.events if ev.event == "slow"]
    recover = [ev for ev in trace.events if ev.event == "recover"]
    assert [ev.time_s for ev in slow] == [3600.0 * k for k in range(1, 5)]
    assert {ev.factor for ev in slow} == {2.0}  # slow_factor defaults to 2
    # slow_for defaults to 30 minutes; the last slowdown's recovery lies past the horizon.
    assert [(ev.time_s, ev.node) for ev in recover] == [(ev.time_s + 1800.0, ev.node) for ev in slow[:-1]]
    assert trace.failures == trace.joins == 0
    assert trace_from_spec("slow_every=1h", initial_nodes=4, horizon_s=4 * 3600).to_list() == trace.to_list()
    assert trace_from_spec("slow_every=1h,seed=1", initial_nodes=4, horizon_s=4 * 3600).to_list() != trace.to_list()


def test_a_slowed_node_is_live_and_not_slow_and_a_failure_ends_its_slowness() -> None:
    # One node slowed every 5 min for 20 min while nodes fail every 7 min: some slow nodes fail.
    trace = trace_from_spec("every=7m,min=2,rejoin=9m,seed=1,slow_every=5m,slow_for=20m", initial_nodes=5,
                            horizon_s=3 * 3600)
    live, slow = set(range(5)), set()
    failed_while_slow = 0
    for ev in trace.events:  # the same rules as the trace's own check, replayed here
        if ev.event == "slow":
            assert ev.node in live and ev.node not in slow
            slow.add(ev.node)
        elif ev.event == "recover":
            assert ev.node in slow
            slow.remove(ev.node)
        elif ev.event == "fail":
            failed_while_slow += ev.node in slow
            live.remove(ev.node)
            slow.discard(ev.node)
        else:
            live.add(ev.node)
    assert failed_while_slow > 0


def test_json_round_trip_with_slow_events(tmp_path: Path) -> None:
    events: list[dict[str, Any]] = [
        {"time_s": 60, "event": "slow", "node": 2, "factor": 2},
        {"time_s": 90, "event": "fail", "node": 1},
        {"time_s": 120, "event": "recover", "node": 2},
        {"time_s": 150, "event": "join", "node": 1},
        {"time_s": 180, "event": "slow", "node": 1, "factor": 1.5},
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(events))
    trace = load_trace(path, initial_nodes=4)
    assert trace.to_list() == [{**e, "time_s": float(e["time_s"]),
                                **({"factor": float(e["factor"])} if "factor" in e else {})} for e in events]
    assert trace_from_json(json.loads(json.dumps(trace.to_list())), initial_nodes=4).events == trace.events
    assert trace.live_counts() == [(0.0, 4), (90.0, 3), (150.0, 4)]  # speed changes are no membership changes
    assert (trace.failures, trace.joins, trace.slowdowns) == (1, 1, 2)


@pytest.mark.parametrize(
    ("events", "message"),
    [
        ([{"time_s": 10, "event": "slow", "node": 7, "factor": 2}], "not live"),
        ([{"time_s": 10, "event": "recover", "node": 1}], "not slow"),
        ([{"time_s": 10, "event": "slow", "node": 1, "factor": 1.0}], "factor must be a finite number > 1"),
        ([{"time_s": 10, "event": "slow", "node": 1, "factor": "x2"}], "factor must be a number"),
        ([{"time_s": 10, "event": "slow", "node": 1}], "exactly time_s, event, node and factor"),
        ([{"time_s": 10, "event": "fail", "node": 1, "factor": 2}], "exactly time_s, event and node"),
        ([{"time_s": 10, "event": "slow", "node": 1, "factor": 2},
          {"time_s": 20, "event": "slow", "node": 1, "factor": 3}], "already slow"),
        ([{"time_s": 10, "event": "slow", "node": 1, "factor": 2}, {"time_s": 20, "event": "fail", "node": 1},
          {"time_s": 30, "event": "recover", "node": 1}], "not live"),
        ([{"time_s": 10, "event": "slow", "node": 1, "factor": 2}, {"time_s": 20, "event": "fail", "node": 1},
          {"time_s": 30, "event": "join", "node": 1}, {"time_s": 40, "event": "recover", "node": 1}], "not slow"),
    ],
)
def test_bad_slow_events_are_refused(events: object, message: str) -> None:
    with pytest.raises(TraceError, match=message):
        trace_from_json(events, initial_nodes=4)


def test_a_factor_belongs_to_slow_events_only() -> None:
    with pytest.raises(TraceError, match="only a slow event has one"):
        Trace(initial_nodes=4, events=(TraceEvent(time_s=1.0, event="fail", node=1, factor=2.0),))
    with pytest.raises(TraceError, match="needs a factor"):
        Trace(initial_nodes=4, events=(TraceEvent(time_s=1.0, event="slow", node=1),))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("slow_for=10m", "without slow_every"),
        ("seed=3", "needs every=T and min=N"),
        ("every=10m,min=2,slow_factor=3", "without slow_every"),
        ("slow_every=0", "slow_every must be > 0"),
        ("slow_every=10m,slow_for=0", "slow_for must be > 0"),
        ("slow_every=10m,slow_factor=1", "slow_factor must be a finite number > 1"),
        ("slow_every=10m,slow_factor=fast", "slow_factor must be a number"),
        ("slow_every=10m,every=10m", "every=T and min=N together"),
        ("slow_every=10m,slow_every=5m", "twice"),
    ],
)
def test_bad_slow_specs_are_refused(spec: str, message: str) -> None:
    with pytest.raises(TraceError, match=message):
        trace_from_spec(spec, initial_nodes=4, horizon_s=3600)
