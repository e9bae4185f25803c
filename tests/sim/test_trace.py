"""Failure traces: the periodic spec, JSON files, and refusal of impossible traces."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from elastic.cli.main import main
from elastic.sim.trace import TraceError, load_trace, parse_duration, trace_from_json, trace_from_spec

pytestmark = pytest.mark.timeout(60)


def test_spec_loses_one_node_every_period_down_to_the_floor() -> None:
    trace = trace_from_spec("every=10m,min=15", initial_nodes=30, horizon_s=6 * 3600)
    assert [ev.time_s for ev in trace.events] == [600.0 * k for k in range(1, 16)]
    assert {ev.event for ev in trace.events} == {"fail"}
    assert len({ev.node for ev in trace.events}) == 15
    assert trace.live_counts()[-1] == (9000.0, 15)


def test_spec_rejoin_brings_each_failed_node_back() -> None:
    trace = trace_from_spec("every=10m,min=2,rejoin=15m", initial_nodes=4, horizon_s=3600)
    failed_at: dict[int, float] = {}
    joins = 0
    for ev in trace.events:
        if ev.event == "fail":
            failed_at[ev.node] = ev.time_s
        else:
            joins += 1
            assert ev.time_s == failed_at[ev.node] + 900
    assert joins >= 2
    assert min(n for _, n in trace.live_counts()) >= 2


def test_json_trace_round_trip(tmp_path: Path) -> None:
    events: list[dict[str, Any]] = [{"time_s": 60, "event": "fail", "node": 2}, {"time_s": 120, "event": "join", "node": 2}]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(events))
    trace = load_trace(path, initial_nodes=4)
    assert trace.to_list() == [{**e, "time_s": float(e["time_s"])} for e in events]
    assert trace.live_counts() == [(0.0, 4), (60.0, 3), (120.0, 4)]


@pytest.mark.parametrize(
    ("events", "message"),
    [
        ([{"time_s": 10, "event": "fail", "node": 7}], "not live"),
        ([{"time_s": 10, "event": "join", "node": 1}], "already live"),
        ([{"time_s": -1, "event": "fail", "node": 1}], ">= 0"),
        ([{"time_s": 10, "event": "explode", "node": 1}], "event must be one of"),
        ([{"time_s": 10, "event": "fail", "node": 1}, {"time_s": 20, "event": "fail", "node": 1}], "not live"),
        ([{"time_s": 10, "event": "fail"}], "exactly time_s, event and node"),
        ([{"time_s": "soon", "event": "fail", "node": 1}], "must be a number"),
        ({"time_s": 10}, "JSON list"),
    ],
)
def test_bad_json_traces_are_refused(events: object, message: str) -> None:
    with pytest.raises(TraceError, match=message):
        trace_from_json(events, initial_nodes=4)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("every=10m", "needs every=T and min=N"),
        ("every=0,min=2", "every must be > 0"),
        ("every=10m,min=9", r"min=9 must be in \[1, 4\]"),
        ("every=10x,min=2", "bad duration"),
        ("every=10m,min=2,speed=3", "bad trace spec item"),
        ("every=10m,min=2,min=3", "twice"),
    ],
)
def test_bad_specs_are_refused(spec: str, message: str) -> None:
    with pytest.raises(TraceError, match=message):
        trace_from_spec(spec, initial_nodes=4, horizon_s=3600)


def test_durations() -> None:
    assert [parse_duration(s) for s in ("90", "90s", "10m", "1.5h")] == [90.0, 90.0, 600.0, 5400.0]


@pytest.mark.parametrize(
    "argv",
    [
        ["--trace", "every=10m,min=99"],
        ["--trace", "/nonexistent/trace.json"],
        ["--trace", "every=10m,min=2", "--policies", "elastic,magic"],
        ["--trace", "every=10m,min=2", "--hours", "0"],
        ["--trace", "every=10m,min=2", "--fault-tolerance", "9"],
    ],
)
def test_cli_refuses_bad_input_with_usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    base = ["simulate", "--model", "gpt3-350m", "--nodes", "4", "--hours", "1"]
    assert main([*base, *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("elastic simulate: error:")
