"""A worker's side of the control plane, without torch: what it watches and writes in etcd.

A failure-free step touches etcd once, off the critical path: world rank 0 hands the committed
step to a `ProgressWriter`, whose thread overwrites the `progress` key. Everything else is read
from watches that fire only when the control plane acts, never per step:

- `GenerationFeed`: generation records (`plan/<g>`); a newer one aborts the current generation;
- `HaltFeed`: the leader's `halt/<g>` requests; an abort halt sets the generation's abort flag,
  a boundary halt is what the worker votes with (`requested`);
- `DecisionFeed`: the leader's decisions (`decisions/<g>/<s>`), for the job's last step only.

A halted worker writes its `SyncReport` (`write_sync`) and waits for the next generation.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
import time
from typing import Any, Protocol

from elastic.coordinator.generations import Generation, Generations
from elastic.coordinator.watch import PrefixWatch, WatchEvent
from elastic.runtime.protocol import (
    COMMIT,
    GenerationRecord,
    HaltRecord,
    ProgressRecord,
    RunKeys,
    StepResult,
    SyncReport,
)

PROGRESS_WINDOW = 8
"""Steps kept in the progress record's `recent` window."""


class Abortable(Protocol):
    """What the feeds need of a generation's abort flag (elastic.parallel.abort.AbortSignal)."""

    def set(self, reason: str) -> None: ...


class GenerationFeed:
    """The job's generation records as they are published; sets the current abort on a newer one."""

    def __init__(self, generations: Generations) -> None:
        self._records: dict[int, tuple[GenerationRecord, float]] = {}
        self._cond = threading.Condition()
        self._abort: Abortable | None = None
        self._current = 0
        self._watch = generations.watch(self._on_generation, after=0)

    def _on_generation(self, gen: Generation) -> None:
        record = GenerationRecord.from_json(gen.plan)
        with self._cond:
            self._records[gen.number] = (record, time.time())
            if gen.number > self._current and self._abort is not None:
                self._abort.set(f"generation {gen.number} published: {record.reason}")
            self._cond.notify_all()

    def enter(self, number: int, abort: Abortable) -> None:
        """Make `number` the current generation, with `abort` set when a newer one appears."""
        with self._cond:
            self._current, self._abort = number, abort
            if self.latest() > number:
                abort.set("a newer generation was already published")

    def latest(self) -> int:
        with self._cond:
            return max(self._records, default=0)

    def get(self, number: int) -> tuple[GenerationRecord, float]:
        """The record of generation `number` and the wall time this worker saw it."""
        with self._cond:
            return self._records[number]

    def wait_newer(self, than: int, timeout: float) -> int:
        """The newest generation number above `than`; TimeoutError after `timeout` s."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.latest() > than, timeout):
                raise TimeoutError(f"no generation after {than} within {timeout:.0f} s")
            return self.latest()

    def close(self) -> None:
        self._watch.cancel()


class HaltFeed:
    """The leader's halt requests, generation -> HaltRecord (an abort halt replaces a boundary one)."""

    def __init__(self, client: Any, rk: RunKeys) -> None:
        self._halts: dict[int, HaltRecord] = {}
        self._cond = threading.Condition()
        self._prefix = rk.halts
        self._current = 0
        self._abort: Abortable | None = None
        resp = client.get_prefix_response(rk.halts)
        for kv in resp.kvs:
            self._add(kv.key.decode(), kv.value)
        self._watch = PrefixWatch(client, rk.halts, self._on_events, start_revision=int(resp.header.revision) + 1)

    def _add(self, key: str, value: bytes) -> None:
        try:
            g, record = int(key[len(self._prefix) :]), HaltRecord.from_json(value)
        except (ValueError, TypeError, KeyError):
            return  # not a halt record: ignored (the leader is the only writer)
        self._halts[g] = record
        if g == self._current and record.abort and self._abort is not None:
            self._abort.set(f"halted by the leader: {record.reason}")

    def _on_events(self, events: list[WatchEvent]) -> None:
        with self._cond:
            for ev in events:
                if ev.kind == "put":
                    self._add(ev.key, ev.value)
            self._cond.notify_all()

    def enter(self, generation: int, abort: Abortable) -> None:
        """Make `generation` current: an abort halt of it (already written or later) sets `abort`."""
        with self._cond:
            self._current, self._abort = generation, abort
            record = self._halts.get(generation)
            if record is not None and record.abort:
                abort.set(f"halted by the leader: {record.reason}")

    def requested(self, generation: int) -> HaltRecord | None:
        """The halt of `generation` written so far (a local lookup: no etcd call)."""
        with self._cond:
            return self._halts.get(generation)

    def close(self) -> None:
        self._watch.cancel()


class DecisionFeed:
    """The leader's commit/abort decisions of the job's last step, (generation, step) -> decision."""

    def __init__(self, client: Any, rk: RunKeys) -> None:
        self._decisions: dict[tuple[int, int], str] = {}
        self._cond = threading.Condition()
        self._prefix = rk.decisions
        resp = client.get_prefix_response(rk.decisions)
        for kv in resp.kvs:
            self._add(kv.key.decode(), kv.value.decode())
        self._watch = PrefixWatch(client, rk.decisions, self._on_events, start_revision=int(resp.header.revision) + 1)

    def _add(self, key: str, value: str) -> None:
        parts = key[len(self._prefix) :].split("/")
        if len(parts) == 2 and all(p.isdigit() for p in parts):
            self._decisions[(int(parts[0]), int(parts[1]))] = value

    def _on_events(self, events: list[WatchEvent]) -> None:
        with self._cond:
            for ev in events:
                if ev.kind == "put":
                    self._add(ev.key, ev.value.decode())
            self._cond.notify_all()

    def wait(self, generation: int, step: int, timeout: float) -> str:
        with self._cond:
            if not self._cond.wait_for(lambda: (generation, step) in self._decisions, timeout):
                raise TimeoutError(f"no decision for step {step} of generation {generation} in {timeout:.0f} s")
            return self._decisions[(generation, step)]

    def committed(self, generation: int, step: int) -> bool:
        with self._cond:
            return self._decisions.get((generation, step)) == COMMIT

    def close(self) -> None:
        self._watch.cancel()


class ProgressWriter:
    """Overwrites the `progress` key from a thread of its own, so the step never waits for etcd.

    Puts happen in commit order; if etcd falls behind by more than the window, the oldest
    unwritten records are dropped (the newest record's `recent` window still names them)."""

    def __init__(self, client: Any, rk: RunKeys) -> None:
        self.client, self.key = client, rk.progress
        self._recent: collections.deque[list[float]] = collections.deque(maxlen=PROGRESS_WINDOW)
        self._queue: queue.Queue[ProgressRecord | None] = queue.Queue(maxsize=PROGRESS_WINDOW)
        self.puts = 0
        """Records written (for benchmarks and tests)."""
        self._thread = threading.Thread(target=self._run, name="progress-writer", daemon=True)
        self._thread.start()

    def publish(self, result: StepResult) -> None:
        """Queue the committed step `result` (never blocks on etcd)."""
        self._recent.append([result.step, result.committed_at, result.seconds])
        record = ProgressRecord(
            step=result.step, loss=result.loss, grad_norm=result.grad_norm, lr=result.lr, seconds=result.seconds,
            generation=result.generation, committed_at=result.committed_at, recent=list(self._recent),
        )  # fmt: skip
        while True:
            try:
                self._queue.put_nowait(record)
                return
            except queue.Full:
                with contextlib.suppress(queue.Empty):
                    self._queue.get_nowait()

    def _run(self) -> None:
        while (record := self._queue.get()) is not None:
            try:
                self.client.put(self.key, record.to_json())
                self.puts += 1
            except Exception:  # etcd away: the next record carries the progress on
                continue

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued, then stop the thread."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            return
        self._thread.join(timeout)


def write_sync(client: Any, rk: RunKeys, generation: int, report: SyncReport) -> None:
    """Report what this halted worker of `generation` holds (the leader waits for every live worker)."""
    client.put(rk.sync_report(generation, report.node, report.local_rank), report.to_json())
