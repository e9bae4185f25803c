"""Failure traces: when nodes fail and rejoin, and when live nodes slow down and recover.

A trace is the initial node count plus a time-ordered list of events, each failing a live node,
(re)joining a node that is not live, slowing a live node down (`slow`: its compute takes
`factor` > 1 times as long) or bringing a slow node back to full speed (`recover`). A node that
fails loses its slowness (it comes back, if it does, at full speed). Two ways to make one:

- a spec string, `every=10m,min=15[,rejoin=30m][,seed=0][,start=10m]`: one live node fails every
  `every` (first at `start`, default `every`) while more than `min` nodes are live; the failing
  node is drawn uniformly from the live ones by a PRNG seeded with `seed`; with `rejoin=R` each
  failed node joins again R later. Durations are seconds, or a number with s, m or h.
  Stragglers, with or without failures: `slow_every=D[,slow_for=30m][,slow_factor=2]` slows one
  live node that is not slow every D (first at D) by `slow_factor` for `slow_for` (then it
  recovers, unless it failed first), drawn by a second PRNG derived from `seed`, so the failures
  and joins are the same events with or without the slow keys. `every` and `min` come together;
  one of `every` and `slow_every` must be given.
- a JSON file: a list of {"time_s": float, "event": "fail" | "join" | "recover", "node": int},
  and {"time_s": float, "event": "slow", "node": int, "factor": float}; a fail event may name
  its "cause" (a string), as the report's events do.
- `llama3[,seed=S][,repair=24h][,restart=2m]`: failures at Llama 3's rate and causes
  (elastic/sim/llama3_trace.py; `elastic/sim/trace_arg.py` tells the three forms apart).

Every trace is checked on construction (TraceError, a ValueError, names the bad event).
"""

from __future__ import annotations

import heapq
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EVENTS = ("fail", "join", "slow", "recover")
MEMBERSHIP = ("fail", "join")
"""The events that change which nodes are live (`slow` and `recover` change only their speed)."""
SPEC_KEYS = ("every", "min", "rejoin", "seed", "start", "slow_every", "slow_for", "slow_factor")
DEFAULT_SLOW_FOR_S = 1800.0
"""`slow_for` when a spec gives `slow_every` without it: 30 minutes."""
DEFAULT_SLOW_FACTOR = 2.0
"""`slow_factor` when a spec gives `slow_every` without it: half speed."""


class TraceError(ValueError):
    """A trace that is malformed or impossible (a dead node failing, a live node joining, ...)."""


@dataclass(frozen=True, kw_only=True)
class TraceEvent:
    """One membership change, or one change of a live node's speed."""

    time_s: float
    """Seconds since the start of the run."""
    event: str
    """'fail' (the node is lost), 'join' (the node becomes available), 'slow' (the node's compute
    takes `factor` times as long) or 'recover' (the slow node is back at full speed)."""
    node: int
    """Node id; the initial nodes are 0 .. initial_nodes - 1, a join may bring a new id."""
    factor: float | None = None
    """'slow' only: how many times as long the node's compute takes (> 1); None otherwise."""
    cause: str | None = None
    """'fail' only, optional: why the node was lost (a Llama 3 trace names its Table 5 cause,
    elastic/sim/llama3_trace.py); policies may pay a different detection for it (config.py)."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"time_s": self.time_s, "event": self.event, "node": self.node}
        if self.factor is not None:
            out["factor"] = self.factor
        if self.cause is not None:
            out["cause"] = self.cause
        return out


@dataclass(frozen=True, kw_only=True)
class Trace:
    """The initial cluster and its membership changes, in time order."""

    initial_nodes: int
    """Nodes live at time 0: ids 0 .. initial_nodes - 1."""
    events: tuple[TraceEvent, ...] = ()
    """Membership and speed changes, sorted by time (ties keep their order)."""
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

    @property
    def slowdowns(self) -> int:
        return sum(1 for ev in self.events if ev.event == "slow")

    def causes(self) -> dict[str, int]:
        """Failures per cause, most frequent first (ties by name); empty if no event names one."""
        counts: dict[str, int] = {}
        for ev in self.events:
            if ev.cause is not None:
                counts[ev.cause] = counts.get(ev.cause, 0) + 1
        return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))

    def until(self, horizon_s: float) -> Trace:
        """The events at or before `horizon_s`."""
        kept = tuple(ev for ev in self.events if ev.time_s <= horizon_s)
        return Trace(initial_nodes=self.initial_nodes, events=kept, description=self.description)

    def live_counts(self) -> list[tuple[float, int]]:
        """(time, live node count from then on), starting with (0, initial_nodes)."""
        out = [(0.0, self.initial_nodes)]
        live = self.initial_nodes
        for ev in self.events:
            if ev.event not in MEMBERSHIP:
                continue  # a change of speed, not of membership
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
    fields = _spec_fields(spec)
    if "every" not in fields and "slow_every" not in fields:
        raise TraceError(f"trace spec {spec!r} needs every=T and min=N (failures), or slow_every=D (stragglers)")
    if ("every" in fields) != ("min" in fields):
        raise TraceError(f"trace spec {spec!r} needs every=T and min=N together")
    seed = _spec_int(fields.get("seed", "0"), "seed")
    events = _failure_events(fields, initial_nodes=initial_nodes, horizon_s=horizon_s, seed=seed) \
        if "every" in fields else []
    if "slow_every" in fields:
        events = _with_slowdowns(events, fields, initial_nodes=initial_nodes, horizon_s=horizon_s, seed=seed)
    return Trace(initial_nodes=initial_nodes, events=tuple(events), description=f"spec {spec}")


def _spec_fields(spec: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    for part in spec.split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in SPEC_KEYS:
            raise TraceError(
                f"bad trace spec item {part!r} in {spec!r}: expected every=T,min=N[,rejoin=R][,seed=S][,start=T0]"
                "[,slow_every=D[,slow_for=D][,slow_factor=F]]"
            )
        if key in fields:
            raise TraceError(f"trace spec {spec!r} gives {key} twice")
        fields[key] = value.strip()
    slow_only = [k for k in ("slow_for", "slow_factor") if k in fields]
    if slow_only and "slow_every" not in fields:
        raise TraceError(f"trace spec {spec!r} gives {', '.join(slow_only)} without slow_every=D")
    return fields


def _failure_events(fields: dict[str, str], *, initial_nodes: int, horizon_s: float, seed: int) -> list[TraceEvent]:
    """The fail and join events of `every`, `min`, `rejoin` and `start` (module docstring)."""
    every = parse_duration(fields["every"])
    if every <= 0:
        raise TraceError(f"trace spec every must be > 0, got {fields['every']!r}")
    start = parse_duration(fields["start"]) if "start" in fields else every
    rejoin = parse_duration(fields["rejoin"]) if "rejoin" in fields else None
    if rejoin is not None and rejoin <= 0:
        raise TraceError(f"trace spec rejoin must be > 0, got {fields['rejoin']!r}")
    floor = _spec_int(fields["min"], "min")
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
    return events


def _with_slowdowns(membership: list[TraceEvent], fields: dict[str, str], *, initial_nodes: int,
                    horizon_s: float, seed: int) -> list[TraceEvent]:
    """`membership` (fail and join events, in time order, kept as they are) with the slow and
    recover events of `slow_every`, `slow_for` and `slow_factor` merged in.

    One timeline in time order; at equal times membership events come first, then recoveries,
    then slowdowns (so a node failing at a slowdown's instant is not drawn). The slowed node is
    drawn uniformly from the live nodes that are not slow, by `random.Random(f"slow:{seed}")`: a
    stream of its own, so that the failure stream is untouched."""
    every = parse_duration(fields["slow_every"])
    if every <= 0:
        raise TraceError(f"trace spec slow_every must be > 0, got {fields['slow_every']!r}")
    duration = parse_duration(fields["slow_for"]) if "slow_for" in fields else DEFAULT_SLOW_FOR_S
    if duration <= 0:
        raise TraceError(f"trace spec slow_for must be > 0, got {fields['slow_for']!r}")
    factor = _spec_factor(fields.get("slow_factor"))
    rng = random.Random(f"slow:{seed}")
    # (time, order, sequence, event or None for a slowdown tick)
    queue: list[tuple[float, int, int, TraceEvent | None]] = [(ev.time_s, 0, i, ev) for i, ev in enumerate(membership)]
    ticks = int(math.floor(horizon_s / every + 1e-9))
    queue += [(k * every, 2, len(membership) + k, None) for k in range(1, ticks + 1)]
    heapq.heapify(queue)
    seq = len(queue)
    live, slow = set(range(initial_nodes)), set[int]()
    out: list[TraceEvent] = []
    while queue:
        t, _, _, ev = heapq.heappop(queue)
        if ev is None:  # a slowdown tick
            candidates = sorted(live - slow)
            if candidates:
                node = rng.choice(candidates)
                slow.add(node)
                out.append(TraceEvent(time_s=t, event="slow", node=node, factor=factor))
                if t + duration <= horizon_s:
                    heapq.heappush(queue, (t + duration, 1, seq, TraceEvent(time_s=t + duration, event="recover",
                                                                            node=node)))
                    seq += 1
            continue
        if ev.event == "recover":
            if ev.node in slow:  # else it failed while slow: nothing to recover
                slow.discard(ev.node)
                out.append(ev)
            continue
        (live.discard if ev.event == "fail" else live.add)(ev.node)
        slow.discard(ev.node)
        out.append(ev)
    return out


def _spec_factor(text: str | None) -> float:
    if text is None:
        return DEFAULT_SLOW_FACTOR
    try:
        value = float(text)
    except ValueError:
        raise TraceError(f"trace spec slow_factor must be a number, got {text!r}") from None
    if not (math.isfinite(value) and value > 1.0):
        raise TraceError(f"trace spec slow_factor must be a finite number > 1, got {text!r}")
    return value


def trace_from_json(data: Any, *, initial_nodes: int, description: str = "") -> Trace:
    """A trace from a JSON value: a list of {time_s, event, node} objects ({time_s, event, node,
    factor} for a `slow` event)."""
    if not isinstance(data, list):
        raise TraceError(f"a trace must be a JSON list of events, got {type(data).__name__}")
    events = [_event_from_json(i, item) for i, item in enumerate(data)]
    events.sort(key=lambda ev: ev.time_s)
    return Trace(initial_nodes=initial_nodes, events=tuple(events), description=description)


def _event_from_json(i: int, item: Any) -> TraceEvent:
    slow = isinstance(item, dict) and item.get("event") == "slow"
    keys = {"time_s", "event", "node", "factor"} if slow else {"time_s", "event", "node"}
    if not isinstance(item, dict) or set(item) - {"cause"} != keys:
        names = "time_s, event, node and factor" if slow else "time_s, event and node"
        raise TraceError(f"trace event {i} must be an object with exactly {names} (and an optional cause): {item!r}")
    cause = item.get("cause")
    if cause is not None and not isinstance(cause, str):
        raise TraceError(f"trace event {i}: cause must be a string, got {cause!r}")
    time_s, event, node = item["time_s"], item["event"], item["node"]
    if isinstance(time_s, bool) or not isinstance(time_s, (int, float)):
        raise TraceError(f"trace event {i}: time_s must be a number, got {time_s!r}")
    if isinstance(node, bool) or not isinstance(node, int):
        raise TraceError(f"trace event {i}: node must be an integer, got {node!r}")
    factor = item.get("factor")
    if slow and (isinstance(factor, bool) or not isinstance(factor, (int, float))):
        raise TraceError(f"trace event {i}: factor must be a number, got {factor!r}")
    return TraceEvent(time_s=float(time_s), event=str(event), node=node,
                      factor=None if factor is None else float(factor), cause=cause)


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
    slow: set[int] = set()
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
        if (ev.factor is not None) != (ev.event == "slow"):
            raise TraceError(f"{where}: a slow event needs a factor, and only a slow event has one")
        if ev.cause is not None and ev.event != "fail":
            raise TraceError(f"{where}: only a fail event has a cause")
        if ev.event in MEMBERSHIP:
            _apply_membership(where, ev, live)
            slow.discard(ev.node)  # a node that fails loses its slowness
        else:
            _apply_speed(where, ev, live, slow)


def _apply_membership(where: str, ev: TraceEvent, live: set[int]) -> None:
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


def _apply_speed(where: str, ev: TraceEvent, live: set[int], slow: set[int]) -> None:
    if ev.node not in live:
        raise TraceError(f"{where}: the node is not live")
    if ev.event == "slow":
        assert ev.factor is not None
        if not (math.isfinite(ev.factor) and ev.factor > 1.0):
            raise TraceError(f"{where}: factor must be a finite number > 1, got {ev.factor}")
        if ev.node in slow:
            raise TraceError(f"{where}: the node is already slow (a recover event must come first)")
        slow.add(ev.node)
    else:
        if ev.node not in slow:
            raise TraceError(f"{where}: the node is not slow")
        slow.remove(ev.node)
