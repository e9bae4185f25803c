"""The watches of one client share one etcd Watch stream (`watch_stream.py`), against etcd's own
count of streams and watchers, and each still gets exactly the changes under its prefix, in
order: through a slow callback, a compaction, a watch added from a callback and an etcd crash.

Each test starts an etcd of its own, so that its /metrics counts only what the test opened.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elastic.coordinator import EtcdConfig, EtcdServer, connect
from elastic.coordinator.watch import PrefixWatch, WatchEvent
from tests.polling import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _gauges(server: EtcdServer) -> tuple[int, int]:
    """etcd's (open watch streams, watchers)."""
    with urllib.request.urlopen(f"http://{server.endpoint}/metrics", timeout=10.0) as resp:
        text = resp.read().decode()
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("etcd_debugging_mvcc_watch_stream_total", "etcd_debugging_mvcc_watcher_total"):
            values[name] = int(float(value))
    return values["etcd_debugging_mvcc_watch_stream_total"], values["etcd_debugging_mvcc_watcher_total"]


class _Seen:
    """What one watch delivered: (key, value) in order, and the revisions (strictly rising)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.items: list[tuple[str, bytes]] = []
        self.revisions: list[int] = []

    def __call__(self, events: list[WatchEvent]) -> None:
        with self.lock:
            self.items.extend((ev.key, ev.value) for ev in events)
            self.revisions.extend(ev.revision for ev in events)

    def snapshot(self) -> list[tuple[str, bytes]]:
        with self.lock:
            assert self.revisions == sorted(set(self.revisions)), "a revision came twice or out of order"
            return list(self.items)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[EtcdServer]:
    with EtcdServer(data_dir=tmp_path / "etcd") as s:
        yield s


@pytest.fixture
def client(server: EtcdServer) -> Iterator[Any]:
    c = connect(EtcdConfig(endpoint=server.endpoint))
    yield c
    c.close()


def _stream_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "etcd-watch-stream")


def test_watches_of_a_client_share_one_stream(server: EtcdServer, client: Any) -> None:
    streams0, watchers0 = _gauges(server)
    prefixes = [f"/share/{i}/" for i in range(12)]
    seen = {p: _Seen() for p in prefixes}
    watches = {p: PrefixWatch(client, p, seen[p]) for p in prefixes}
    twin = _Seen()  # a second watch on the same prefix gets the same changes
    watches["twin"] = PrefixWatch(client, prefixes[0], twin)
    assert all(w.wait_ready(10.0) for w in watches.values())
    assert _gauges(server) == (streams0 + 1, watchers0 + 13)
    assert _stream_threads() == 1

    expected: dict[str, list[tuple[str, bytes]]] = {p: [] for p in prefixes}
    for round_ in range(5):
        for i, p in enumerate(prefixes):
            key, value = f"{p}k{round_ % 2}", f"{round_}-{i}".encode()
            client.put(key, value)
            expected[p].append((key, value))
    client.put("/share/elsewhere", b"x")  # under no watched prefix
    for p in prefixes:
        wait_for(lambda p=p: len(seen[p].snapshot()) >= len(expected[p]), 10.0, f"the puts under {p}")
    wait_for(lambda: len(twin.snapshot()) >= len(expected[prefixes[0]]), 10.0, "the twin's puts")
    time.sleep(0.3)  # room for a stray or duplicate delivery to show
    assert {p: seen[p].snapshot() for p in prefixes} == expected
    assert twin.snapshot() == expected[prefixes[0]]

    # Cancelling some leaves the rest on the same stream; cancelling all closes it.
    for p in prefixes[:6]:
        watches.pop(p).cancel()
    wait_for(lambda: _gauges(server) == (streams0 + 1, watchers0 + 7), 10.0, "etcd to drop 6 watchers")
    client.put(prefixes[0] + "late", b"1")
    client.put(prefixes[6] + "late", b"2")
    wait_for(lambda: twin.snapshot()[-1:] == [(prefixes[0] + "late", b"1")], 10.0, "the twin's late put")
    wait_for(lambda: seen[prefixes[6]].snapshot()[-1:] == [(prefixes[6] + "late", b"2")], 10.0, "a late put")
    assert seen[prefixes[0]].snapshot() == expected[prefixes[0]], "a cancelled watch delivered"
    for w in watches.values():
        w.cancel()
    wait_for(lambda: _gauges(server) == (streams0, watchers0), 10.0, "etcd to close the stream")
    wait_for(lambda: _stream_threads() == 0, 10.0, "the stream's thread to end")

    # A new watch on the same client opens a new stream.
    again = _Seen()
    w = PrefixWatch(client, prefixes[1], again)
    assert w.wait_ready(10.0)
    client.put(prefixes[1] + "again", b"3")
    wait_for(lambda: again.snapshot() == [(prefixes[1] + "again", b"3")], 10.0, "the new watch's put")
    w.cancel()


def test_a_slow_callback_holds_up_only_its_own_watch(client: Any) -> None:
    release = threading.Event()
    slow_seen = _Seen()

    def slow(events: list[WatchEvent]) -> None:
        release.wait(30.0)
        slow_seen(events)

    fast_seen = _Seen()
    slow_watch = PrefixWatch(client, "/slow/", slow)
    fast_watch = PrefixWatch(client, "/fast/", fast_seen)
    try:
        assert slow_watch.wait_ready(10.0) and fast_watch.wait_ready(10.0)
        client.put("/slow/a", b"1")
        client.put("/slow/b", b"2")
        for i in range(5):
            client.put("/fast/k", str(i).encode())
        # The slow callback is stuck on its first change; the other watch gets all of its own.
        wait_for(lambda: len(fast_seen.snapshot()) == 5, 10.0, "the fast watch's puts")
        assert slow_seen.snapshot() == []
        release.set()
        wait_for(lambda: slow_seen.snapshot() == [("/slow/a", b"1"), ("/slow/b", b"2")], 10.0, "the slow watch")
        assert slow_watch.next_revision is not None and fast_watch.next_revision is not None
        assert slow_watch.next_revision < fast_watch.next_revision  # delivered, not received
    finally:
        release.set()
        slow_watch.cancel()
        fast_watch.cancel()


def test_a_compacted_watch_resumes_alone(client: Any) -> None:
    old = client.put("/comp/a/0", b"0").header.revision
    client.put("/comp/a/1", b"1")
    kept = client.put("/comp/a/2", b"2").header.revision
    client.put("/comp/b/0", b"x")
    client.compact(kept, physical=True)
    other_seen = _Seen()
    other = PrefixWatch(client, "/comp/b/", other_seen)
    assert other.wait_ready(10.0)
    seen = _Seen()
    compacted = PrefixWatch(client, "/comp/a/", seen, start_revision=old)  # history before `kept` is gone
    try:
        assert compacted.wait_ready(10.0)
        client.put("/comp/a/3", b"3")
        client.put("/comp/b/1", b"y")
        wait_for(lambda: seen.snapshot()[-1:] == [("/comp/a/3", b"3")], 10.0, "the compacted watch's new put")
        assert seen.snapshot() == [("/comp/a/2", b"2"), ("/comp/a/3", b"3")]  # from `kept` on
        wait_for(lambda: other_seen.snapshot() == [("/comp/b/1", b"y")], 10.0, "the other watch's put")
    finally:
        compacted.cancel()
        other.cancel()


def test_a_watch_added_from_a_callback(client: Any) -> None:
    inner_seen = _Seen()
    inner: list[PrefixWatch] = []

    def outer_cb(events: list[WatchEvent]) -> None:
        if not inner:
            inner.append(PrefixWatch(client, "/inner/", inner_seen, start_revision=events[-1].revision + 1))
            assert inner[0].wait_ready(10.0)

    outer = PrefixWatch(client, "/outer/", outer_cb)
    try:
        assert outer.wait_ready(10.0)
        rev = client.put("/outer/go", b"1").header.revision
        client.put("/inner/x", b"2")
        wait_for(lambda: inner and inner[0].next_revision and inner[0].next_revision > rev + 1, 10.0, "the inner watch")
        assert inner_seen.snapshot() == [("/inner/x", b"2")]
    finally:
        outer.cancel()
        for w in inner:
            w.cancel()


def test_every_watch_resumes_after_an_etcd_crash(server: EtcdServer, client: Any) -> None:
    prefixes = [f"/crash/{i}/" for i in range(6)]
    seen = {p: _Seen() for p in prefixes}
    connected: list[bool] = []
    watches = [PrefixWatch(client, p, seen[p], on_connection=connected.append) for p in prefixes]
    try:
        assert all(w.wait_ready(10.0) for w in watches)
        expected: dict[str, list[tuple[str, bytes]]] = {p: [] for p in prefixes}

        def put_round(tag: str) -> None:
            for p in prefixes:
                client.put(p + tag, tag.encode())
                expected[p].append((p + tag, tag.encode()))

        put_round("before")
        server.stop(kill=True)
        time.sleep(1.0)
        server.start()
        put_round("after")  # the retrying client waits for etcd
        for p in prefixes:
            wait_for(lambda p=p: seen[p].snapshot() == expected[p], 20.0, f"the puts under {p} after the crash")
        assert connected.count(False) == len(prefixes) and connected.count(True) == 2 * len(prefixes)
        assert _gauges(server)[0] == 1
    finally:
        for w in watches:
            w.cancel()



def test_store_waits_ride_the_stream_and_survive_an_etcd_crash(server: EtcdServer, client: Any) -> None:
    """12 blocked `EtcdStore.get`s on 3 keys share the client's one stream with its other watch
    (one watcher a key, shared by its 4 waits), outlive an etcd SIGKILL and restart, and return
    what was set after it."""
    from datetime import timedelta

    from elastic.coordinator import EtcdStore, JobKeys

    other_watch = PrefixWatch(client, "/other/", lambda events: None)
    assert other_watch.wait_ready(10.0)
    store = EtcdStore(client, JobKeys("waits").store("g"), timeout=timedelta(seconds=30))
    got: dict[int, bytes] = {}
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, store.get(f"k{i % 3}"))) for i in range(12)]
    for t in threads:
        t.start()
    wait_for(lambda: _gauges(server) == (1, 4), 10.0, "one stream, and one watcher a key for 12 waits")
    server.stop(kill=True)
    time.sleep(1.0)
    server.start()
    writer = connect(EtcdConfig(endpoint=server.endpoint))
    try:
        other = EtcdStore(writer, JobKeys("waits").store("g"))
        for k in range(3):
            other.set(f"k{k}", f"v{k}")
        for t in threads:
            t.join(20.0)
        assert got == {i: f"v{i % 3}".encode() for i in range(12)}
    finally:
        writer.close()
        store.release()
        other_watch.cancel()
