"""The agent's InjectionTrigger on a real etcd: a committed step's `progress` put reaches only the
agents with an injection waiting for a step (etcd's own watcher count), and such an injection
still fires when its step is in flight."""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from typing import Any

import pytest

from elastic.coordinator import EtcdServer, JobKeys
from elastic.coordinator.keys import RunKeys
from elastic.records.injection_requests import InjectionRequest
from elastic.records.progress import ProgressRecord
from elastic.roles.injection_trigger import InjectionTrigger

_WATCHERS = re.compile(r"^etcd_debugging_mvcc_watcher_total (\d+)", re.M)


def watchers(endpoint: str) -> int:
    """Watchers etcd serves now (every client, every stream)."""
    text = urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10).read().decode()
    found = _WATCHERS.search(text)
    assert found is not None
    return int(found.group(1))


def settle(endpoint: str, expected: int) -> int:
    """etcd's watcher count once it reaches `expected` (watch creation and cancellation are
    asynchronous), else what it is after 5 s."""
    deadline = time.monotonic() + 5
    while (now := watchers(endpoint)) != expected and time.monotonic() < deadline:
        time.sleep(0.02)
    return now


def commit(client: Any, rk: RunKeys, step: int) -> None:
    record = ProgressRecord(step=step, loss=2.0, grad_norm=1.0, lr=1e-3, seconds=0.1, generation=1,
                            committed_at=time.time(), recent=[])
    client.put(rk.progress, record.to_json())


@pytest.mark.timeout(60)
def test_only_a_waiting_injection_watches_progress(etcd_server: EtcdServer, client: Any, job: str) -> None:
    keys = JobKeys(job)
    rk = RunKeys(keys)
    commit(client, rk, 0)
    before = watchers(etcd_server.endpoint)
    triggers = [InjectionTrigger(client, keys) for _ in range(4)]
    try:
        # Each watches the generation records only: no progress watch while nothing waits.
        assert settle(etcd_server.endpoint, before + 4) == before + 4
        assert [t.in_flight() for t in triggers] == [2] * 4  # read on demand
        stop = threading.Event()
        request = InjectionRequest(id="i1", kind="kill", node=0, incarnation=0, when="step", step=6)
        fired: list[bool] = []
        waiter = threading.Thread(target=lambda: fired.append(triggers[0].wait(request, stop)))
        waiter.start()
        assert settle(etcd_server.endpoint, before + 5) == before + 5  # one more: the waiting one
        # and it asks the progress writer for the short interval while it waits
        assert len(list(client.get_prefix(rk.prefix("step-waiters"), keys_only=True))) == 1
        for step in range(1, 4):
            commit(client, rk, step)
        waiter.join(0.3)
        assert waiter.is_alive()  # step 6 is not in flight before step 4 (index) is committed
        commit(client, rk, 4)
        waiter.join(10)
        assert fired == [True]
        assert triggers[0].in_flight() == 6
        assert settle(etcd_server.endpoint, before + 4) == before + 4  # its watch is gone with it
        assert list(client.get_prefix(rk.prefix("step-waiters"), keys_only=True)) == []  # its key too
        assert triggers[3].in_flight() == 6  # the others read it when asked
    finally:
        for t in triggers:
            t.close()
