"""The progress writer against a real etcd: fast steps share puts, yet every step reaches a
watcher of the `progress` key with its own figures; slow steps get a put each, at once; the
long interval holds while no one waits on a step, the short one while a `step-waiters/` key is
there."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import pytest

from elastic.coordinator import JobKeys
from elastic.coordinator.keys import RunKeys
from elastic.coordinator.watch import WatchEvent, watch_from_now
from elastic.records.progress import ProgressRecord, StepResult
from elastic.roles.worker_feeds import ProgressWriter

pytestmark = pytest.mark.timeout(60)


def result(step: int) -> StepResult:
    return StepResult(step=step, loss=10.0 - step / 7, grad_norm=1.0 + step / 3, lr=1e-3 * (step % 5 + 1),
                      seconds=0.01 * step, generation=2, committed_at=1000.0 + step)


class Seen:
    """Every progress record a watch delivered, in order."""

    def __init__(self, client: Any, rk: RunKeys) -> None:
        self.records: list[ProgressRecord] = []
        self._lock = threading.Lock()
        self._watch = watch_from_now(client, rk.progress, self._on)

    def _on(self, events: list[WatchEvent]) -> None:
        with self._lock:
            self.records += [ProgressRecord.from_json(ev.value) for ev in events if ev.kind == "put"]

    def until(self, step: int, timeout: float = 10.0) -> list[ProgressRecord]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self.records and self.records[-1].step >= step:
                    return list(self.records)
            time.sleep(0.01)
        raise AssertionError(f"step {step} never reached the watch")

    def close(self) -> None:
        self._watch.cancel()


def test_fast_steps_share_puts_and_every_step_is_reported(client: Any) -> None:
    rk = RunKeys(JobKeys(f"pw-{uuid.uuid4().hex[:8]}"))
    seen = Seen(client, rk)
    writer = ProgressWriter(client, rk, min_interval_s=0.2)
    steps = 40
    try:
        for s in range(steps):
            writer.publish(result(s))
            time.sleep(0.01)  # ~0.4 s of steps: a handful of puts
        records = seen.until(steps - 1)
    finally:
        writer.close()
        seen.close()
    assert writer.puts == len(records) < steps / 4
    reported = [r for rec in records for r in rec.results()]
    assert reported == [result(s) for s in range(steps)]  # each once, in order, with its own figures
    assert records[-1].recent[-1] == [steps - 1, 1000.0 + steps - 1, 0.01 * (steps - 1)]


def test_slow_steps_are_written_one_put_each(client: Any) -> None:
    rk = RunKeys(JobKeys(f"pw-{uuid.uuid4().hex[:8]}"))
    seen = Seen(client, rk)
    writer = ProgressWriter(client, rk, min_interval_s=0.05, idle_interval_s=0.05)
    try:
        for s in range(5):
            writer.publish(result(s))
            records = seen.until(s, timeout=2.0)  # written without waiting for the next step
            time.sleep(0.1)
    finally:
        writer.close()
        seen.close()
    assert [rec.step for rec in records] == list(range(5))
    assert all(rec.earlier == [] for rec in records)


def wait_for_interval(writer: ProgressWriter, seconds: float) -> None:
    deadline = time.monotonic() + 10
    while writer.interval() != seconds:
        assert time.monotonic() < deadline, f"the writer's interval stayed {writer.interval()}"
        time.sleep(0.01)


def test_a_step_waiter_shortens_the_interval_and_its_end_lengthens_it(client: Any) -> None:
    rk = RunKeys(JobKeys(f"pw-{uuid.uuid4().hex[:8]}"))
    seen = Seen(client, rk)
    # idle 30 s: a step held back by the idle interval cannot reach the watch within the test
    writer = ProgressWriter(client, rk, min_interval_s=0.05, idle_interval_s=30.0)
    waiter = rk.job.key("step-waiters", "test")
    try:
        writer.publish(result(0))
        seen.until(0)  # the first put is at once
        wait_for_interval(writer, 30.0)  # its waiter watch is open and sees no waiter
        writer.publish(result(1))
        time.sleep(0.5)
        assert seen.records[-1].step == 0  # held back: no one waits
        client.put(waiter, "")
        records = seen.until(1)  # the waiter wakes the writer: written now, not 30 s on
        assert records[-1].step == 1 and records[-1].earlier == []
        client.delete(waiter)
        wait_for_interval(writer, 30.0)
        writer.publish(result(2))
        time.sleep(0.5)
        assert seen.records[-1].step == 1
    finally:
        writer.close()
    try:
        assert seen.until(2)[-1].step == 2  # closing writes what is gathered at once
        assert writer.puts == 3
    finally:
        seen.close()


def test_a_writer_that_never_publishes_holds_no_thread(client: Any) -> None:
    rk = RunKeys(JobKeys(f"pw-{uuid.uuid4().hex[:8]}"))

    def writer_threads() -> int:
        return sum(t.name == "progress-writer" for t in threading.enumerate())

    before = writer_threads()
    writers = [ProgressWriter(client, rk) for _ in range(8)]  # a node's workers: only rank 0 publishes
    try:
        assert writer_threads() == before
        writers[0].publish(result(0))
        assert writer_threads() == before + 1
    finally:
        for w in writers:
            w.close()
    assert writer_threads() == before
