"""World rank 0's straggler reporter (issue 33: measure, detect, show): it takes each committed
step's forward, backward and wait seconds per node (the vote carries them,
elastic/parallel/grad_sync.py; busy is forward plus backward), keeps the
speed factors and marks (elastic/planning/stragglers.py) on a thread of its own, off the step's
path, and writes the `stragglers` key and a `straggler` / `straggler-cleared` event per change.

The first `SETTLE_STEPS` steps of each generation are left out (they connect gloo's pairs and
warm caches). A new rank 0 (after a re-plan) starts from the marks the key holds, so a mark
outlives the writer that set it; its history of factors starts again.

The settings are the run's with the operator's changes (`elastic stragglers --policy ...`, the
`straggler-policy` key), read once a second: a change takes effect within about a second, with
no restart. Under `off` the steps are not taken in and every mark is cleared (an event each).
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import math
import os
import statistics
import threading
import time
from dataclasses import dataclass

from elastic.coordinator.etcd_api import EtcdClient
from elastic.coordinator.events import record_event
from elastic.coordinator.keys import JobKeys
from elastic.parallel.phase_clock import STEP_PHASES, StepPhases
from elastic.planning.stragglers import Change, NodeWork, SpeedTracker, StragglerConfig, node_work
from elastic.records.stragglers import (
    PUT_EVERY_S,
    Mark,
    StragglerRecord,
    read_policy,
    read_stragglers,
    stragglers_key,
)
from templates.plan import Plan

TRACE_ENV = "ELASTIC_BUSY_TRACE"
"""A file to which world rank 0 appends each committed step's busy seconds per node, one JSON
line a step (`{"step", "generation", "busy": {node: seconds}, "phases": {node: [forward,
backward, wait]}}`): the series the detector's tests replay (tests/planning/data/)."""
SETTLE_STEPS = 2
"""Steps of a generation that are not taken in (module doc)."""
log = logging.getLogger(__name__)
_QUEUE = 256
"""Steps waiting for the thread at most (it keeps up; older ones are dropped if it does not)."""


@dataclass(frozen=True)
class _Observed:
    step: int
    generation: int
    work: dict[int, NodeWork]
    phases: dict[int, StepPhases]

    @property
    def busy(self) -> dict[int, float]:
        return {n: p.busy for n, p in self.phases.items()}


class StragglerReporter:
    """The reporter of one worker while it is world rank 0 (module doc)."""

    def __init__(self, client: EtcdClient, keys: JobKeys, config: StragglerConfig, *, who: str) -> None:
        self.client, self.keys, self.base, self.who = client, keys, config, who
        self.tracker = SpeedTracker(config)
        self._latest = (-1, 0)
        """(step, generation) of the last committed step handed over."""
        self._marks: dict[int, Mark] = {}
        self._unrecorded: list[tuple[Change, str]] = []
        """Marks and clears announced, their events not yet recorded (`_record_events`)."""
        self._queue: collections.deque[_Observed] = collections.deque(maxlen=_QUEUE)
        self._cond = threading.Condition()
        self._closing = False
        self._plan: tuple[int, int, dict[int, NodeWork]] | None = None
        """(generation, its first step seen here, each node's work in it)."""
        self.puts = 0
        self._phases: dict[int, collections.deque[StepPhases]] = {}
        """Node -> its phases of the last `window` steps taken in under the current generation."""
        trace = os.environ.get(TRACE_ENV)
        self._trace = open(trace, "a", buffering=1) if trace else None  # noqa: SIM115 - closed in close()
        self._thread = threading.Thread(target=self._run, name="straggler-reporter", daemon=True)
        self._thread.start()

    @property
    def config(self) -> StragglerConfig:
        """The settings in force: the run's (`base`) with the operator's changes (the tracker's)."""
        return self.tracker.config

    def observe(self, *, step: int, generation: int, phases: dict[int, StepPhases], plan: Plan) -> None:
        """Queue one committed step (never blocks on etcd)."""
        if self._trace is not None:
            rounded = {n: round(p.busy, 5) for n, p in phases.items()}
            split = {n: [round(v, 5) for v in p.values()] for n, p in phases.items()}
            line = {"step": step, "generation": generation, "busy": rounded, "phases": split}
            self._trace.write(json.dumps(line) + "\n")
        self._latest = (step, generation)
        if self._plan is None or self._plan[0] != generation:
            self._plan = (generation, step, node_work(plan))
        _, first, work = self._plan
        if step - first < SETTLE_STEPS or not phases or self.config.policy == "off":
            return
        with self._cond:
            self._queue.append(_Observed(step, generation, work, phases))
            self._cond.notify()

    def close(self, timeout: float = 5.0) -> None:
        """Take in what is queued, write the record, stop the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout)
        if self._trace is not None:
            self._trace.close()

    # -- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            record = read_stragglers(self.client, self.keys)
        except Exception:  # noqa: BLE001 - an unreadable or unreachable record: start without marks
            record = None
        if record is not None and self.config.policy != "off":
            self._marks = dict(record.marked)
            self.tracker.marked.update({n: m.since_step for n, m in record.marked.items()})
        next_put = next_read = 0.0
        last: _Observed | None = None
        unwritten = False
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queue) or self._closing, timeout=1.0)
                batch, closing = list(self._queue), self._closing
                self._queue.clear()
            if time.monotonic() >= next_read:
                next_read = time.monotonic() + PUT_EVERY_S
                if self._refresh_settings():
                    unwritten, next_put = True, 0.0
                    if self.config.policy == "off":
                        batch, last = [], None
            changes: list[Change] = []
            for seen in batch:
                if last is not None and seen.generation != last.generation:
                    self.tracker.new_plan()
                    self._phases.clear()
                changes += self.tracker.observe(seen.step, seen.busy, seen.work)
                for node, phases in seen.phases.items():
                    if node in seen.work and phases.busy > 0:
                        window = self._phases.setdefault(node, collections.deque(maxlen=self.config.window))
                        window.append(phases)
                last = seen
            unwritten = unwritten or bool(batch)
            for change in changes:
                self._announce(change)
            if unwritten and (changes or closing or time.monotonic() >= next_put):
                self._put(last)
                unwritten, next_put = False, time.monotonic() + PUT_EVERY_S
            self._record_events()  # after the record: whoever reads an event finds its mark
            if closing:
                return

    def _refresh_settings(self) -> bool:
        """Take in the operator's changes (module doc); whether the settings changed."""
        try:
            config = read_policy(self.client, self.keys, self.base)
        except ValueError as exc:  # a malformed change (the CLI checks what it writes): keep these
            log.warning("%s: ignoring the straggler settings in etcd: %s", self.who, exc)
            return False
        except Exception:  # noqa: BLE001 - etcd away: the settings in force stay
            return False
        if config == self.config:
            return False
        log.warning("%s: straggler settings changed: %s -> %s", self.who, self.config, config)
        self.tracker.config = config
        if config.policy == "off":
            step = self._latest[0]
            for node in sorted(self.tracker.marked):
                self._announce(Change(node=node, marked=False, step=step, factor=float("nan")),
                               why="the straggler policy is now off")
            self.tracker = SpeedTracker(config)
        return True

    def _announce(self, change: Change, *, why: str | None = None) -> None:
        if change.marked:
            self._marks[change.node] = Mark(since_step=change.step, since=time.time(), factor=round(change.factor, 3))
            detail = (f"{change.factor:.2f}x its peers' time for {self.config.steps} steps "
                      f"(threshold {self.config.threshold:g})")
        else:
            mark = self._marks.pop(change.node, None)
            since = f" since step {mark.since_step + 1}" if mark is not None else ""
            detail = (f"{why or 'left the plan'}{since}" if math.isnan(change.factor) else
                      f"back to {change.factor:.2f}x its peers for {self.config.steps} steps{since}")
        self._unrecorded.append((change, detail))

    def _record_events(self) -> None:
        """The events of the marks announced since the last call (the record was written first)."""
        while self._unrecorded:
            change, detail = self._unrecorded.pop(0)
            factor = None if math.isnan(change.factor) else round(change.factor, 3)
            with contextlib.suppress(Exception):  # etcd away: the record (`_put`) still carries the mark
                record_event(self.client, self.keys, who=self.who, node=change.node, step=change.step,
                             factor=factor, kind="straggler" if change.marked else "straggler-cleared",
                             reason=detail)

    def _put(self, last: _Observed | None) -> None:
        """Write the record: of the last step taken in, whose generation the busy seconds are of
        (the leader re-splits on them only for its current generation); of the last step handed
        over when none was taken in (a change to `off`)."""
        step, generation = (last.step, last.generation) if last is not None else self._latest
        record = StragglerRecord(
            step=step, generation=generation, at=time.time(), policy=self.config.policy,
            threshold=self.config.threshold,
            factors={n: round(f, 3) for n, f in sorted(self.tracker.smoothed().items())},
            busy={n: round(b, 5) for n, b in sorted(self.tracker.busy_seconds().items())},
            phases={n: _medians(w) for n, w in sorted(self._phases.items()) if len(w) == w.maxlen},
            marked=dict(sorted(self._marks.items())),
        )
        try:
            self.client.put(stragglers_key(self.keys), record.to_json())
            self.puts += 1
        except Exception:  # noqa: BLE001 - etcd away: the next write carries the state on
            pass


def _medians(window: collections.deque[StepPhases]) -> list[float]:
    """The median of each phase over `window` (`STEP_PHASES` order), rounded for the record."""
    return [round(statistics.median(getattr(p, f) for p in window), 5) for f in STEP_PHASES]
