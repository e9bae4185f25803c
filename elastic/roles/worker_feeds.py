"""A worker's side of the control plane, without torch: what it watches and writes in etcd.

A failure-free step touches etcd at most once, off the critical path: world rank 0 hands the
committed step to a `ProgressWriter`, whose thread overwrites the `progress` key (at most every
`PROGRESS_MIN_INTERVAL_S` while someone waits on a step, every `PROGRESS_IDLE_INTERVAL_S`
otherwise; fast steps share a put). Everything else is read
from watches that fire only when the control plane acts, never per step:

- `GenerationFeed`: generation records (`plan/<g>`); a newer one aborts the current generation;
- `HaltFeed`: the leader's `halt/<g>` requests; an abort halt sets the generation's abort flag,
  a boundary halt is what the worker votes with (`requested`);
- `DecisionFeed`: the leader's decisions (`decisions/<g>/<s>`), for the job's last step only.

Each follows its prefix through `subscribe` (`watch_from_now`'s semantics): an elastic worker's
goes through its node's agent, which watches each prefix once for the node
(elastic/roles/node_feed.py); the default is a watch of the worker's own.

A halted worker writes its `SyncReport` and its holdings (`write_sync`, one transaction) and
waits for the next generation.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Sequence
from typing import Protocol

from elastic.coordinator.etcd_api import EtcdClient
from elastic.coordinator.generations import Generation, Generations
from elastic.coordinator.keys import RunKeys
from elastic.coordinator.watch import PrefixWatch, Subscribe, WatchEvent, watch_from_now
from elastic.records.generation import GenerationRecord, HaltRecord
from elastic.records.node_holdings import NodeHoldings, node_holdings_key
from elastic.records.node_sync import NodeSyncReports
from elastic.records.progress import ProgressRecord, StepResult
from elastic.records.sync import COMMIT, SyncReport
from elastic.roles.etcd_writes import Fold
from elastic.roles.node_relay import RelayClient, put_all

PROGRESS_WINDOW = 8
"""Steps kept in the progress record's `recent` window."""
PROGRESS_MIN_INTERVAL_S = 0.1
"""Least time between two puts of the `progress` key while someone waits on a step (a
`step-waiters/` key: an agent's injection waits for its step)."""
PROGRESS_IDLE_INTERVAL_S = 0.5
"""Least time between two puts while no one waits on a step: the launcher's step lines, status
and metrics are then at most this stale (issue 34: the control plane's CPU is taken from the
workers on a shared machine; a put costs the writer, etcd and every watcher)."""
PROGRESS_EARLIER_MAX = 64
"""Most gathered steps one progress record names in `earlier`."""


class Abortable(Protocol):
    """What the feeds need of a generation's abort flag (elastic.parallel.abort.AbortSignal)."""

    def set(self, reason: str, *, local: bool = False) -> None: ...


def _follow(client: EtcdClient, subscribe: Subscribe | None) -> Subscribe:
    """`subscribe`, or a watch of this client's own."""
    return subscribe if subscribe is not None else lambda prefix, on_events: watch_from_now(client, prefix, on_events)


class GenerationFeed:
    """The job's generation records as they are published; sets the current abort on a newer one."""

    def __init__(self, generations: Generations, *, subscribe: Subscribe | None = None) -> None:
        self._records: dict[int, tuple[GenerationRecord, float]] = {}
        self._revisions: dict[int, int] = {}
        self._cond = threading.Condition()
        self._abort: Abortable | None = None
        self._current = 0
        self._watch = generations.watch(self._on_generation, after=0, subscribe=subscribe)

    def _on_generation(self, gen: Generation) -> None:
        record = GenerationRecord.from_json(gen.plan)
        with self._cond:
            self._records[gen.number] = (record, time.time())
            self._revisions[gen.number] = gen.revision
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

    def revision(self, number: int) -> int:
        """The etcd revision at which generation `number` was published."""
        with self._cond:
            return self._revisions[number]

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

    def __init__(self, client: EtcdClient, rk: RunKeys, *, subscribe: Subscribe | None = None) -> None:
        self._halts: dict[int, HaltRecord] = {}
        self._cond = threading.Condition()
        self._prefix = rk.halts
        self._current = 0
        self._abort: Abortable | None = None
        self._mine: frozenset[int] = frozenset()
        self._watch = _follow(client, subscribe)(rk.halts, self._on_events)

    def _add(self, key: str, value: bytes) -> None:
        try:
            g, record = int(key[len(self._prefix) :]), HaltRecord.from_json(value)
        except (ValueError, TypeError, KeyError):
            return  # not a halt record: ignored (the leader is the only writer)
        self._halts[g] = record
        if g == self._current and record.abort and self._abort is not None:
            self._set(self._abort, record)

    def _set(self, abort: Abortable, record: HaltRecord) -> None:
        local = bool(self._mine and record.lost) and not self._mine & set(record.lost)
        abort.set(f"halted by the leader: {record.reason}", local=local)

    def _on_events(self, events: list[WatchEvent]) -> None:
        with self._cond:
            for ev in events:
                if ev.kind == "put":
                    self._add(ev.key, ev.value)
            self._cond.notify_all()

    def enter(self, generation: int, abort: Abortable, *, pipeline: frozenset[int] = frozenset()) -> None:
        """Make `generation` current: an abort halt of it (already written or later) sets `abort`.
        `pipeline`: the nodes of this worker's pipeline; an abort halt that names lost nodes,
        none of them, sets a local abort (the pipeline finishes its microbatches)."""
        with self._cond:
            self._current, self._abort, self._mine = generation, abort, pipeline
            record = self._halts.get(generation)
            if record is not None and record.abort:
                self._set(abort, record)

    def requested(self, generation: int) -> HaltRecord | None:
        """The halt of `generation` written so far (a local lookup: no etcd call)."""
        with self._cond:
            return self._halts.get(generation)

    def close(self) -> None:
        self._watch.cancel()


class DecisionFeed:
    """The leader's commit/abort decisions of the job's last step, (generation, step) -> decision."""

    def __init__(self, client: EtcdClient, rk: RunKeys, *, subscribe: Subscribe | None = None) -> None:
        self._decisions: dict[tuple[int, int], str] = {}
        self._cond = threading.Condition()
        self._prefix = rk.prefix("decisions")
        self._watch = _follow(client, subscribe)(rk.prefix("decisions"), self._on_events)

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

    A committed step is written at once when the previous put is at least an interval old;
    faster steps are gathered and the newest is written when the interval has passed, naming the
    ones before it in `earlier`. The interval is `min_interval_s` while someone waits on a step
    (a key under `step-waiters/`, which the writer's thread watches from its first put on; also
    until that watch is open) and `idle_interval_s` otherwise, so etcd and every watcher of the
    key see at most 1 / interval puts a second, whatever the step rate. Steps beyond
    `PROGRESS_EARLIER_MAX` gathered ones are named only in the step logs."""

    def __init__(
        self, client: EtcdClient, rk: RunKeys, *, min_interval_s: float = PROGRESS_MIN_INTERVAL_S,
        idle_interval_s: float = PROGRESS_IDLE_INTERVAL_S,
    ) -> None:
        self.client, self.key, self.min_interval_s = client, rk.progress, min_interval_s
        self.idle_interval_s = max(idle_interval_s, min_interval_s)
        self._waiters_prefix = rk.prefix("step-waiters")
        self._waiters: set[str] | None = None
        """Keys under `step-waiters/` (None until the watch is open: the short interval)."""
        self._waiter_watch: PrefixWatch | None = None
        self._recent: collections.deque[list[float]] = collections.deque(maxlen=PROGRESS_WINDOW)
        self._pending: collections.deque[StepResult] = collections.deque(maxlen=PROGRESS_EARLIER_MAX + 1)
        self._cond = threading.Condition()
        self._closing = False
        self.puts = 0
        """Records written (for benchmarks and tests)."""
        self._thread: threading.Thread | None = None
        """Started by the first `publish`: only world rank 0 publishes, so every other worker's
        writer holds no thread."""

    def publish(self, result: StepResult) -> None:
        """Queue the committed step `result` (never blocks on etcd)."""
        with self._cond:
            self._recent.append([result.step, result.committed_at, result.seconds])
            self._pending.append(result)
            self._cond.notify()
            if self._thread is None and not self._closing:
                self._thread = threading.Thread(target=self._run, name="progress-writer", daemon=True)
                self._thread.start()

    def interval(self) -> float:
        """The least time between two puts now (class doc)."""
        with self._cond:
            return self.min_interval_s if self._waiters is None or self._waiters else self.idle_interval_s

    def _on_waiters(self, events: list[WatchEvent]) -> None:
        with self._cond:
            waiters = self._waiters if self._waiters is not None else set()
            for ev in events:
                (waiters.add if ev.kind == "put" else waiters.discard)(ev.key)
            self._waiters = waiters
            self._cond.notify_all()  # a new waiter shortens the wait under way

    def _follow_waiters(self) -> None:
        """Open the `step-waiters/` watch (writer thread; on failure the next put tries again)."""
        if self._waiter_watch is not None:
            return
        try:
            self._waiter_watch = watch_from_now(self.client, self._waiters_prefix, self._on_waiters)
        except Exception:  # etcd away: keep the short interval
            return
        with self._cond:
            if self._waiters is None:
                self._waiters = set()

    def _take(self) -> ProgressRecord | None:
        """The record of every step gathered so far (None once closed with nothing left)."""
        with self._cond:
            self._cond.wait_for(lambda: bool(self._pending) or self._closing)
            if not self._pending:
                return None
            *earlier, last = self._pending
            self._pending.clear()
            recent = [r for r in self._recent if r[0] <= last.step]
        return ProgressRecord(
            step=last.step, loss=last.loss, grad_norm=last.grad_norm, lr=last.lr, seconds=last.seconds,
            generation=last.generation, committed_at=last.committed_at, recent=recent,
            earlier=[[r.step, r.loss, r.grad_norm, r.lr, r.seconds, r.committed_at]
                     for r in earlier if r.generation == last.generation],
        )

    def _wait_interval(self, last_put: float) -> None:
        """Gather steps until an interval has passed since `last_put` (closing: at once)."""
        with self._cond:
            while not self._closing:
                left = last_put + self.interval() - time.monotonic()  # the condition's lock is an RLock
                if left <= 0:
                    return
                self._cond.wait(left)

    def _run(self) -> None:
        last_put = -float("inf")
        try:
            while True:
                self._wait_interval(last_put)
                record = self._take()
                if record is None:
                    return
                last_put = time.monotonic()
                try:
                    self.client.put(self.key, record.to_json())
                    self.puts += 1
                except Exception:  # etcd away: the next record carries the progress on
                    continue
                self._follow_waiters()
        finally:
            if self._waiter_watch is not None:
                self._waiter_watch.cancel()

    def close(self, timeout: float = 5.0) -> None:
        """Write what is gathered, then stop the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)


def write_sync(
    client: EtcdClient, rk: RunKeys, generation: int, report: SyncReport, *,
    holdings: Sequence[tuple[int, int]] | None = None, lease: int | None = None, relay: RelayClient | None = None,
) -> None:
    """Report what this halted worker of `generation` committed (the leader waits for every live
    worker), folded into its node's `sync/<g>/<node>/all` (elastic/records/node_sync.py), and, with
    `holdings`, the shards it holds now, folded into `holdings/<node>/all` on the node's `lease`
    (elastic/records/node_holdings.py), in the same transaction: the next generation's holder map and the leader's gap check read
    them once every live worker has halted (elastic/roles/holders.py). Through the node's `relay`
    when there is one (elastic/roles/node_relay.py): one transaction a node."""
    folds: list[Fold] = [(rk.node_sync(generation, report.node), NodeSyncReports.of([report]))]
    if holdings is not None:
        held = NodeHoldings(node=report.node, held={report.local_rank: sorted((int(a), int(b)) for a, b in holdings)})
        folds.append((node_holdings_key(rk, report.node), held, lease))
    put_all(client, relay, [], folds)
