"""`elastic events`: a job's history, oldest first, merged from what etcd holds.

Sources, in etcd revision order (one total order, whatever the writers' clocks say):

    events/        the append-only log (elastic/coordinator/events.py): join, failure, fatal, spare
                   (a node kept as a hot spare), spare-taken (a spare taken in for a lost node), and
                   whatever else the runtime records there (kind and detail passed through)
    plan/<g>       kind "generation": every published generation (reason, lost and joined nodes,
                   resume step, restored checkpoint, pipelines)
    injected/<n>   kind "injection": a fault an agent (or the launcher) carried out
    recoveries/<g> kind "recovered": once every worker of generation g > 1 reported its timings,
                   the breakdown of elastic.records.recoveries.recovery_breakdown

A generation or an injection that both has its own key and is logged in events/ is shown once.

Each `HistoryEvent` has `time` (wall time, Unix seconds; null where the writer recorded none,
e.g. the first generation), `kind`, `who` (member id, "leader", "launcher" or an agent),
`revision` (etcd mod revision of the key it was read from), `key` and `detail` (a JSON object).
`History.poll()` returns only events it has not returned before, so `--follow` re-reads
and prints what is new.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from elastic.coordinator.etcd_api import EtcdClient, KVMetadata
from elastic.coordinator.jsonrecord import to_data
from elastic.coordinator.keys import JobKeys, RunKeys
from elastic.records.generation import GenerationRecord
from elastic.records.recoveries import recovery_breakdown
from elastic.records.recovery_timings import RecoveryTimings, workers_reported
from elastic.records.run_end import ENDINGS, RunEnd


@dataclass(frozen=True, kw_only=True)
class HistoryEvent:
    """One thing that happened to the job."""

    kind: str
    """join, failure, fatal, generation, injection, recovered, or a kind another writer logs; "ended"
    is the last line of a run that has ended (elastic/ops/run_history.py `end_event`), from no key."""
    time: float | None
    """Wall time (Unix seconds) the writer recorded, or None where it recorded none."""
    who: str
    """Who did or saw it: a member id (for an injection: its target), "leader" or "workers"."""
    revision: int
    """etcd mod revision of the key it comes from (the history's order)."""
    key: str
    """The etcd key it was read from."""
    detail: dict[str, Any] = field(default_factory=dict)
    """Kind-specific fields."""

    def to_json(self) -> str:
        """One line of `elastic events --json`. Not a JsonRecord: an operator's output, never
        read back into this type, so it carries no schema version."""
        return json.dumps(to_data(self), sort_keys=True)


def _from_log(value: bytes, meta: KVMetadata) -> HistoryEvent:
    data = json.loads(value)
    kind, who, when = data.pop("kind", "?"), data.pop("who", "?"), data.pop("time", None)
    return HistoryEvent(kind=str(kind), time=when, who=str(who), revision=meta.mod_revision,
                        key=meta.key.decode(), detail=data)


def _generation(g: int, rec: GenerationRecord, meta: KVMetadata) -> HistoryEvent:
    detail = {
        "generation": g,
        "reason": rec.reason,
        "resume_step": rec.resume_step,
        "lost_nodes": rec.lost,
        "joined_nodes": rec.joined,
        "drained_nodes": rec.drained,
        "restore_checkpoint": rec.restore_checkpoint,
        "pipelines": [list(p.nodes) for p in rec.plan.pipelines],
        "replayed_fraction": rec.replayed_fraction,
    }
    return HistoryEvent(kind="generation", time=rec.published_at, who="leader", revision=meta.mod_revision,
                        key=meta.key.decode(), detail=detail)


class History:
    """Reads a job's history; `poll()` returns events not returned by earlier polls."""

    def __init__(self, client: EtcdClient, keys: JobKeys) -> None:
        self.client = client
        self.keys = keys
        self.rk = RunKeys(keys)
        self._seen: set[str] = set()

    @property
    def sources(self) -> tuple[str, ...]:
        """The key prefixes the history is read from (what `--follow` watches)."""
        return (self.keys.events, self.keys.plans, self.rk.injected(""), self.rk.recoveries)

    def read_all(self) -> list[HistoryEvent]:
        """Every event the job has now, oldest first (also marks them seen)."""
        events = [_from_log(value, meta) for value, meta in self.client.get_prefix(self.keys.events)]
        generations: dict[int, GenerationRecord] = {}
        for value, meta in self.client.get_prefix(self.keys.plans):
            g = int(meta.key.decode().rsplit("/", 1)[1])
            generations[g] = GenerationRecord.from_json(value)
            events.append(_generation(g, generations[g], meta))
        for value, meta in self.client.get_prefix(self.rk.injected("")):
            key = meta.key.decode()
            name = key.rsplit("/", 1)[1]
            target = next((part for part in name.split("-") if part.startswith("node")), "?")
            events.append(HistoryEvent(kind="injection", time=float(value.decode()), who=target,
                                       revision=meta.mod_revision, key=key, detail={"id": name}))
        events += self._recoveries(generations)
        events = self._dedupe(events)
        events.sort(key=lambda e: (e.revision, e.key))
        self._seen.update(e.key for e in events)
        return events

    def _dedupe(self, events: list[HistoryEvent]) -> list[HistoryEvent]:
        """One event per generation and per injection id: both have a key of their own (plan/,
        injected/) and may be logged in events/ too. The one already returned wins (so `poll`
        never repeats), else the richer one: the plan record, the agent's log entry."""
        groups: dict[tuple[str, Any], list[HistoryEvent]] = {}
        out = []
        for e in events:
            ident = e.detail.get("generation") if e.kind == "generation" else e.detail.get("id")
            if e.kind in ("generation", "injection") and ident is not None:
                groups.setdefault((e.kind, ident), []).append(e)
            else:
                out.append(e)
        for (kind, _), group in groups.items():
            seen = [e for e in group if e.key in self._seen]
            preferred = [
                e
                for e in group
                if e.key.startswith(self.keys.plans if kind == "generation" else self.keys.events)
            ]
            chosen = (seen or preferred or group)[0]
            for other in group:  # keep what only the other copy says (e.g. a generation's drained nodes)
                extra = {k: v for k, v in other.detail.items()
                         if k not in chosen.detail and f"{k}_nodes" not in chosen.detail}
                chosen = replace(chosen, time=chosen.time if chosen.time is not None else other.time,
                                 detail={**chosen.detail, **extra})
            out.append(chosen)
        return out

    def _recoveries(self, generations: dict[int, GenerationRecord]) -> list[HistoryEvent]:
        out = []
        for g, rec in sorted(generations.items()):
            if g == 1:
                continue
            pairs = list(self.client.get_prefix(self.rk.prefix("recoveries", g)))
            timings = [RecoveryTimings.from_json(v) for v, _ in pairs]
            if workers_reported(timings) < len(rec.plan.nodes) * rec.plan.gpus_per_node:
                continue  # still reconfiguring, or cut short by a later generation
            b = recovery_breakdown(self.client, self.rk, g, rec, timings)
            detail = {k: b[k] for k in ("generation", "lost_nodes", "joined_nodes", "drained_nodes", "detecting_s",
                                        "finishing_s", "planning_s", "transferring_s", "rebuilding_s", "replaying_s",
                                        "total_s", "bytes_moved", "replayed_fraction")}
            out.append(HistoryEvent(kind="recovered", time=b["first_commit_at"], who="workers",
                                    revision=max(t.last_revision or m.mod_revision  # a summary: its records'
                                                 for t, (_, m) in zip(timings, pairs, strict=True)),
                                    key=self.rk.prefix("recoveries", g), detail=detail))
        return out

    def poll(self) -> list[HistoryEvent]:
        """Events that appeared since the last `read_all`/`poll`, oldest first."""
        seen = set(self._seen)
        return [e for e in self.read_all() if e.key not in seen]


def describe(event: HistoryEvent) -> str:
    """One line of words for an event (the kind and time are printed beside it)."""
    d = event.detail
    if event.kind == "join":
        return f"{event.who} joined (incarnation {d.get('incarnation')})"
    if event.kind == "failure":
        return f"{d.get('node')} (incarnation {d.get('incarnation')}) reported failed by {event.who}: {d.get('reason')}"
    if event.kind == "generation":
        text = f"generation {d['generation']}: {d['reason']}, from step {d['resume_step'] + 1}, pipelines {d['pipelines']}"
        if d["restore_checkpoint"] is not None:
            text += f", restoring the checkpoint of step {d['restore_checkpoint']}"
        if d.get("replayed_fraction") is not None:
            text += f", replaying {d['replayed_fraction']:.0%} of step {d['resume_step'] + 1}"
        return text
    if event.kind == "injection":
        text = f"injected {d.get('id')}"
        return text + (f" (step {d['step']} in flight)" if isinstance(d.get("step"), int) else "")
    if event.kind in ("drain", "drain-refused"):
        verb = "drained" if event.kind == "drain" else "drain refused"
        return f"node {d.get('node')} {verb} by {event.who}: {d.get('reason')}"
    if event.kind == "recovered":
        return (
            f"recovered into generation {d['generation']} in {d['total_s']:.2f} s (detect {d['detecting_s']:.2f}, "
            f"plan {d['planning_s']:.2f}, transfer {d['transferring_s']:.2f}, rebuild {d['rebuilding_s']:.2f}, "
            f"replay {d['replaying_s']:.2f}; {d['bytes_moved']} bytes"
            + ("" if d.get("replayed_fraction") is None else f"; replayed {d['replayed_fraction']:.0%} of the step")
            + ")"
        )
    if event.kind == "preempted":
        return f"{event.who} (incarnation {d.get('incarnation')}) got SIGTERM: asked for drain {d.get('id')}"
    if event.kind == "fenced":
        return f"{event.who} (incarnation {d.get('incarnation')}) was fenced: {d.get('reason')}"
    if event.kind == "fenced-rejoin":  # elastic run --rejoin-fenced (elastic/roles/run_loop.py)
        return (f"node {d.get('node')} left fenced while it lived (incarnation {d.get('fenced')}): {event.who} "
                f"started incarnation {d.get('incarnation')}, which joins like a new node")
    if event.kind == "checkpoint-failed":
        return f"node {d.get('node')} worker {d.get('local_rank')} could not save the checkpoint of step {d.get('step')}: {d.get('reason')}"
    if event.kind == "checkpoint-skipped":
        return f"the fallback skipped the checkpoint of step {d.get('step')}: {d.get('reason')}"
    if event.kind == "fatal":
        return f"the leader gave up: {d.get('reason')}"
    if event.kind == "stopped":  # a whole-job stop that saves (elastic/records/stop.py)
        return (f"the job stops after step {d.get('step')} (generation {d.get('generation')}, asked by "
                f"{d.get('by')}): every worker writes its checkpoint of that step and leaves")
    if event.kind == "straggler":  # elastic/roles/straggler_reporter.py
        return f"node {d.get('node')} is a straggler after step {d.get('step', 0) + 1}: {d.get('reason')}"
    if event.kind == "straggler-cleared":
        return f"node {d.get('node')} is no longer a straggler after step {d.get('step', 0) + 1}: {d.get('reason')}"
    if event.kind == "straggler-action":  # the leader under --straggler-policy auto
        return f"straggler node {d.get('node')} at {d.get('factor')}x: {d.get('reason')}"
    if event.kind == "straggler-policy":  # elastic stragglers --policy ...
        return f"straggler settings changed by {event.who}: {d.get('reason')}"
    if event.kind == "spare":
        return f"node {d.get('node')} (incarnation {d.get('incarnation')}) is a hot spare"
    if event.kind == "spare-taken":
        why = f"drained node(s) {d['drained']}" if d.get("drained") else f"lost node(s) {d.get('lost')}"
        return (f"hot spare node {d.get('node')} (incarnation {d.get('incarnation')}) taken in for {why} "
                f"by generation {d.get('generation')}")
    if event.kind == "started":
        return (
            f"{event.who} (incarnation {d.get('incarnation')}) started {'warm' if d.get('warm') else 'cold'}: "
            f"workers registered {d.get('total_s')} s after the agent's start (agent {d.get('agent_s')} s, "
            f"then per worker: process {d.get('process_s')} s, imports {d.get('imports_s')} s, "
            f"setup {d.get('setup_s')} s)"
        )
    if event.kind == "ended" and d.get("how") in ENDINGS:  # an ended run's last line (elastic/ops/run_history.py)
        return RunEnd.from_dict(d).describe()
    rest = ", ".join(f"{k}={v}" for k, v in sorted(d.items()))
    return f"{event.who}: {rest}" if rest else event.who


def render_line(event: HistoryEvent, origin: float | None) -> str:
    """`+SECONDS  KIND  description`, seconds relative to `origin` (the first event's time)."""
    when = "?" if event.time is None or origin is None else f"+{event.time - origin:.3f}s"
    return f"{when:>11}  {event.kind:<10}  {describe(event)}"


def first_time(events: list[HistoryEvent]) -> float | None:
    """The earliest recorded time among `events` (the origin of relative times)."""
    times = [e.time for e in events if e.time is not None]
    return min(times) if times else None
