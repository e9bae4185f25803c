"""PrefixMirror (elastic/coordinator/prefix_mirror.py) on a real etcd, against direct reads of the
same keys: what was there before it started, puts and deletes after, a malformed value dropped,
and `on_change` running only once the batch it reports is in the mirror (the leader's rounds,
woken by it, must find the report that woke them)."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest

from elastic.coordinator.prefix_mirror import PrefixMirror

pytestmark = pytest.mark.timeout(60)


def _direct(client: Any, prefix: str) -> dict[str, Any]:
    return {m.key.decode()[len(prefix):]: json.loads(v) for v, m in client.get_prefix(prefix)}


def _until(cond: Any, what: str) -> None:
    deadline = time.monotonic() + 10
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_the_mirror_is_what_a_read_gives(client: Any, job: str) -> None:
    prefix = f"/{job}/sync/"
    for i in range(5):
        client.put(f"{prefix}1/{i}/0", json.dumps({"n": i}))
    seen: list[dict[str, Any]] = []
    mirror: PrefixMirror | None = None

    def changed() -> None:  # runs after the batch is applied: it sees what woke it
        if mirror is not None:
            seen.append(mirror.items())

    mirror = PrefixMirror(client, prefix, json.loads, on_change=changed)
    try:
        assert mirror.items() == _direct(client, prefix)  # what was there before it started
        client.put(f"{prefix}1/9/0", json.dumps({"n": 9}))
        _until(lambda: any("1/9/0" in s for s in seen), "the put's change")
        first = next(s for s in seen if "1/9/0" in s)
        assert first["1/9/0"] == {"n": 9}
        client.delete(f"{prefix}1/0/0")
        client.put(f"{prefix}1/1/0", "not json")  # dropped, as a read that skips it would
        _until(lambda: "1/1/0" not in mirror.items() and "1/0/0" not in mirror.items(), "the delete and the bad value")
        direct = {k: v for k, v in _direct_raw(client, prefix).items() if k != "1/1/0"}
        assert mirror.items() == direct
        assert mirror.pick(["1/2/0", "1/9/0", "1/0/0", "7/7/7"]) == {"1/2/0": {"n": 2}, "1/9/0": {"n": 9}}
    finally:
        mirror.close()


def _direct_raw(client: Any, prefix: str) -> dict[str, Any]:
    out = {}
    for v, m in client.get_prefix(prefix):
        try:
            out[m.key.decode()[len(prefix):]] = json.loads(v)
        except ValueError:
            out[m.key.decode()[len(prefix):]] = None
    return out


def test_a_waiter_woken_by_on_change_finds_the_change(client: Any, job: str) -> None:
    """The leader's pattern: a thread waits on an Event that on_change sets, then picks the keys."""
    prefix = f"/{job}/sync/"
    wake = threading.Event()
    mirror = PrefixMirror(client, prefix, json.loads, on_change=wake.set)
    try:
        for i in range(20):
            wake.clear()
            client.put(f"{prefix}2/{i}/0", json.dumps({"n": i}))
            assert wake.wait(10)
            assert mirror.pick([f"2/{i}/0"]) == {f"2/{i}/0": {"n": i}}
    finally:
        mirror.close()


def test_the_leader_reads_etcd_when_its_mirror_lacks_reports(client: Any, job: str) -> None:
    """The mirror is a speed-up, never the authority: reports its watch did not deliver (here: a
    mirror closed before they were written) are read from etcd once a count says all are there."""
    from elastic.coordinator.keys import JobKeys, RunKeys
    from elastic.records.node_sync import NodeSyncReports, reports_of
    from elastic.records.sync import SyncReport
    from elastic.roles.leader_sync import sync_reports

    rk = RunKeys(JobKeys(job))
    expected = {(0, 0), (1, 0), (1, 1)}
    reports = {k: SyncReport(committed=7, pending=None, last_vote=None, node=k[0], local_rank=k[1]) for k in expected}
    client.put(rk.sync_report(4, 0, 0), reports[(0, 0)].to_json())  # a worker's own key
    mirror = PrefixMirror(client, rk.prefix("sync"), reports_of)
    mirror.close()
    assert sync_reports(client, rk, mirror, 4, expected) is None  # etcd lacks two as well
    client.put(rk.node_sync(4, 1), NodeSyncReports.of([reports[(1, 0)], reports[(1, 1)]]).to_json())  # a node's
    assert mirror.pick(["4/1/all"]) == {}
    assert sync_reports(client, rk, mirror, 4, expected) == [reports[k] for k in sorted(expected)]
