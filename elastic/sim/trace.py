"""Failure traces: when nodes fail and rejoin.

A trace is the initial node count plus a time-ordered list of events, each failing a live node
or (re)joining a node that is not live. Two ways to make one:

- a spec string, `every=10m,min=15[,rejoin=30m][,seed=0][,start=10m]`: one live node fails every
  `every` (first at `start`, default `every`) while more than `min` nodes are live; the failing
  node is drawn uniformly from the live ones by a PRNG seeded with `seed`; with `rejoin=R` each
  failed node joins again R later. Durations are seconds, or a number with s, m or h.
- a JSON file: a list of {"time_s": float, "event": "fail" | "join", "node": int}.

Every trace is checked on construction (TraceError, a ValueError, names the bad event).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EVENTS = ("fail", "join")


class TraceError(ValueError):
    """A trace that is malformed or impossible (a dead node failing, a live node joining, ...)."""


@dataclass(frozen=True, kw_only=True)
class TraceEvent:
    """One membership change."""

    time_s: float
    """Seconds since the start of the run."""
    event: str
    """'fail' (the node is lost) or 'join' (the node becomes available)."""
    node: int
    """Node id; the initial nodes are 0 .. initial_nodes - 1, a join may bring a new id."""

    def to_dict(self) -> dict[str, Any]:
        return {"time_s": self.time_s, "event": self.event, "node": self.node}


@dataclass(frozen=True, kw_only=True)
class Trace:
    """The initial cluster and its membership changes, in time order."""

    initial_nodes: int
    """Nodes live at time 0: ids 0 .. initial_nodes - 1."""
    events: tuple[TraceEvent, ...] = ()
    """Membership changes, sorted by time (ties keep their order)."""
    description: str = ""
    """Where the trace comes from (the spec string or the file name)."""

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def failures(self) -> int:
        return sum(1 for ev in self.events if ev.event == "fail")

    @property
    def joins(self) -> int:
        return sum(1 for ev in self.events if ev.event == "join")

    def until(self, horizon_s: float) -> Trace:
        """The events at or before `horizon_s`."""
        kept = tuple(ev for ev in self.events if ev.time_s <= horizon_s)
        return Trace(initial_nodes=self.initial_nodes, events=kept, description=self.description)

    def live_counts(self) -> list[tuple[float, int]]:
        """(time, live node count from then on), starting with (0, initial_nodes)."""
        out = [(0.0, self.initial_nodes)]
        live = self.initial_nodes
        for ev in self.events:
            live += -1 if ev.event == "fail" else 1
            out.append((ev.time_s, live))
        return out

    def to_list(self) -> list[dict[str, Any]]:
        return [ev.to_dict() for ev in self.events]


def parse_duration(text: str) -> float:
    """Seconds from '90', '90s', '10m' or '1.5h'; TraceError otherwise."""
    scale = {"s": 1.0, "m": 60.0, "h": 3600.0}
    body = text.strip()
    factor = 1.0
    if body and body[-1] in scale:
        factor = scale[body[-1]]
        body = body[:-1]
    try:
        value = float(body) * factor
    except ValueError:
        raise TraceError(f"bad duration {text!r}: use seconds or a number with s, m or h (e.g. 10m)") from None
    if not math.isfinite(value) or value < 0:
        raise TraceError(f"bad duration {text!r}: must be a finite number >= 0")
    return value


def trace_from_spec(spec: str, *, initial_nodes: int, horizon_s: float) -> Trace:
    """The periodic trace described by `spec` over [0, horizon_s] (see the module docstring)."""
    fields: dict[str, str] = {}
    for part in spec.split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in ("every", "min", "rejoin", "seed", "start"):
            raise TraceError(
                f"bad trace spec item {part!r} in {spec!r}: expected every=T,min=N[,rejoin=R][,seed=S][,start=T0]"
            )
        if key in fields:
            raise TraceError(f"trace spec {spec!r} gives {key} twice")
        fields[key] = value.strip()
    if "every" not in fields or "min" not in fields:
        raise TraceError(f"trace spec {spec!r} needs every=T and min=N")
    every = parse_duration(fields["every"])
    if every <= 0:
        raise TraceError(f"trace spec every must be > 0, got {fields['every']!r}")
    start = parse_duration(fields["start"]) if "start" in fields else every
    rejoin = parse_duration(fields["rejoin"]) if "rejoin" in fields else None
    if rejoin is not None and rejoin <= 0:
        raise TraceError(f"trace spec rejoin must be > 0, got {fields['rejoin']!r}")
    floor = _spec_int(fields["min"], "min")
    seed = _spec_int(fields.get("seed", "0"), "seed")
    if not 1 <= floor <= initial_nodes:
        raise TraceError(f"trace spec min={floor} must be in [1, {initial_nodes}] (the initial node count)")

    rng = random.Random(seed)
    live = set(range(initial_nodes))
    pending: list[tuple[float, int]] = []  # (rejoin time, node)
    events: list[TraceEvent] = []
    t = start
    while t <= horizon_s:
        for when, node in sorted(pending):
            if when <= t:
                events.append(TraceEvent(time_s=when, event="join", node=node))
                live.add(node)
        pending = [(w, n) for w, n in pending if w > t]
        if len(live) > floor:
            node = rng.choice(sorted(live))
            live.remove(node)
            events.append(TraceEvent(time_s=t, event="fail", node=node))
            if rejoin is not None:
                pending.append((t + rejoin, node))
        t += every
    events += [TraceEvent(time_s=w, event="join", node=n) for w, n in sorted(pending) if w <= horizon_s]
    events.sort(key=lambda ev: ev.time_s)
    return Trace(initial_nodes=initial_nodes, events=tuple(events), description=f"spec {spec}")


def trace_from_json(data: Any, *, initial_nodes: int, description: str = "") -> Trace:
    """A trace from a JSON value: a list of {time_s, event, node} objects."""
    if not isinstance(data, list):
        raise TraceError(f"a trace must be a JSON list of events, got {type(data).__name__}")
    events = []
    for i, item in enumerate(data):
        if not isinstance(item, dict) or set(item) != {"time_s", "event", "node"}:
            raise TraceError(f"trace event {i} must be an object with exactly time_s, event and node: {item!r}")
        time_s, event, node = item["time_s"], item["event"], item["node"]
        if isinstance(time_s, bool) or not isinstance(time_s, (int, float)):
            raise TraceError(f"trace event {i}: time_s must be a number, got {time_s!r}")
        if isinstance(node, bool) or not isinstance(node, int):
            raise TraceError(f"trace event {i}: node must be an integer, got {node!r}")
        events.append(TraceEvent(time_s=float(time_s), event=str(event), node=node))
    events.sort(key=lambda ev: ev.time_s)
    return Trace(initial_nodes=initial_nodes, events=tuple(events), description=description)


def load_trace(path: str | Path, *, initial_nodes: int) -> Trace:
    """The trace in JSON file `path`."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise TraceError(f"cannot read trace {str(path)!r}: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"trace {str(path)!r} is not valid JSON: {exc}") from None
    return trace_from_json(data, initial_nodes=initial_nodes, description=f"file {path}")


def _spec_int(text: str, name: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise TraceError(f"trace spec {name} must be an integer, got {text!r}") from None


def _validate(trace: Trace) -> None:
    if trace.initial_nodes < 1:
        raise TraceError(f"a trace needs at least 1 initial node, got {trace.initial_nodes}")
    live = set(range(trace.initial_nodes))
    last = 0.0
    for i, ev in enumerate(trace.events):
        where = f"trace event {i} ({ev.event} node {ev.node} at {ev.time_s:g} s)"
        if not math.isfinite(ev.time_s) or ev.time_s < 0:
            raise TraceError(f"{where}: time must be a finite number >= 0")
        if ev.time_s < last:
            raise TraceError(f"{where}: events must be in time order")
        last = ev.time_s
        if ev.event not in EVENTS:
            raise TraceError(f"{where}: event must be one of {EVENTS}")
        if ev.node < 0:
            raise TraceError(f"{where}: node ids must be >= 0")
        if ev.event == "fail":
            if ev.node not in live:
                raise TraceError(f"{where}: the node is not live")
            if len(live) == 1:
                raise TraceError(f"{where}: the last live node cannot fail")
            live.remove(ev.node)
        else:
            if ev.node in live:
                raise TraceError(f"{where}: the node is already live")
            live.add(ev.node)
