"""When an agent's injection fires: a step-numbered one once its step is in flight, a
"reconfig" one once a reconfiguration begins, a "now" one at once.

The `progress` key is written once per committed step. An agent watches it only while one of its
injections waits for a step (almost never): a step's put then wakes the launcher and those
agents, not every agent of the job (issue 34: a progress put wakes only the watchers that need
it). Otherwise the trigger reads the key when asked. The generation records (one put per
generation) are watched all the time.

While it watches, the trigger also holds a `step-waiters/<name>` key (on the agent's node lease,
so it goes with the agent): the progress writer then puts at its short interval, so the step is
seen within `PROGRESS_MIN_INTERVAL_S` of its commit; with no waiter it puts every
`PROGRESS_IDLE_INTERVAL_S` (elastic/roles/worker_feeds.py).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from elastic.coordinator.etcd_api import EtcdClient
from elastic.coordinator.keys import JobKeys, RunKeys
from elastic.coordinator.watch import PrefixWatch, WatchEvent
from elastic.records.injection_requests import InjectionRequest
from elastic.records.progress import ProgressRecord, add_step_waiter, drop_step_waiter


class InjectionTrigger:
    """Fires when a step-numbered injection's step is in flight, or when a reconfiguration begins."""

    def __init__(self, client: EtcdClient, keys: JobKeys, *, lease: int | None = None) -> None:
        self._client = client
        self._rk = RunKeys(keys)
        self._progress_key = self._rk.progress
        self._waiter: str | None = None
        """The step-waiters key held while `_holders` > 0 (module doc)."""
        self._lease = lease
        self._committed = -1
        """Index of the furthest committed step seen (-1: none)."""
        self._last: tuple[float, float] = (0.0, 0.0)
        """(commit wall time, seconds) of that step."""
        self._generations = 0
        self._cond = threading.Condition()
        self._watch_lock = threading.Lock()
        self._progress: PrefixWatch | None = None
        """The watch on `progress`, while `_holders` > 0."""
        self._holders = 0
        """Injections waiting for a step, plus one if `pin`ned."""
        self._read_progress()
        plans = client.get_prefix_response(keys.plans, count_only=True)
        self._generations = int(plans.count)
        self._plans = PrefixWatch(client, keys.plans, self._on_plans, start_revision=int(plans.header.revision) + 1)

    def _read_progress(self) -> int:
        """Take in the `progress` key as it is now; the revision it was read at."""
        resp = self._client.get_prefix_response(self._progress_key)
        self._on_progress([WatchEvent(kind="put", key=kv.key.decode(), value=kv.value, prev_value=None,
                                      revision=kv.mod_revision) for kv in resp.kvs])
        return int(resp.header.revision)

    def _on_progress(self, events: list[WatchEvent]) -> None:
        with self._cond:
            for ev in events:
                if ev.kind == "put":
                    with contextlib.suppress(ValueError, TypeError, KeyError):
                        record = ProgressRecord.from_json(ev.value)
                        if record.step > self._committed:
                            self._committed, self._last = record.step, (record.committed_at, record.seconds)
            self._cond.notify_all()

    def _on_plans(self, events: list[WatchEvent]) -> None:
        with self._cond:
            self._generations += sum(1 for ev in events if ev.kind == "put")
            self._cond.notify_all()

    def _hold(self) -> None:
        """Watch `progress` (what is there now, then every change after it) until `_release`."""
        with self._watch_lock:
            self._holders += 1
            if self._progress is None:
                self._waiter = add_step_waiter(self._client, self._rk, lease=self._lease)
                revision = self._read_progress()
                self._progress = PrefixWatch(self._client, self._progress_key, self._on_progress,
                                             start_revision=revision + 1)

    def _release(self) -> None:
        with self._watch_lock:
            self._holders -= 1
            if self._holders == 0 and self._progress is not None:
                self._progress.cancel()
                self._progress = None
                self._unwait()

    def _unwait(self) -> None:
        if self._waiter is not None:
            drop_step_waiter(self._client, self._waiter)
            self._waiter = None

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Watch `progress` while inside (`in_flight` then reads no key)."""
        self._hold()
        try:
            yield
        finally:
            self._release()

    def pin(self) -> None:
        """Watch `progress` for good, as if an injection always waited (bench/control_plane_shard.py
        measures that worst case)."""
        self._hold()

    def in_flight(self) -> int:
        """The step (1-based) in flight as far as this trigger knows (read now if not watching)."""
        with self._watch_lock:
            if self._progress is None:
                self._read_progress()
        with self._cond:
            return self._committed + 2

    def wait(self, inj: InjectionRequest, stop: threading.Event) -> bool:
        """Block until `inj` should fire (True) or `stop` is set (False)."""

        def due() -> bool:
            if stop.is_set() or inj.when == "now":
                return True
            if inj.when == "reconfig":
                return self._generations >= 2
            assert inj.step is not None
            # Step k (1-based) is in flight once step k-1 (index k-2) is committed.
            return self._generations >= 1 if inj.step == 1 else self._committed >= inj.step - 2

        watching = inj.when == "step" and inj.step is not None and inj.step > 1
        if watching:
            self._hold()
        try:
            with self._cond:
                while not due():
                    self._cond.wait(0.5)
                committed_at, seconds = self._last
        finally:
            if watching:
                self._release()
        if inj.at and inj.when == "step" and not stop.is_set():  # part-way into the step
            stop.wait(max(0.0, committed_at + inj.at * seconds - time.time()))
        return not stop.is_set()

    def close(self) -> None:
        self._plans.cancel()
        with self._watch_lock:
            if self._progress is not None:
                self._progress.cancel()
                self._progress = None
                self._unwait()
