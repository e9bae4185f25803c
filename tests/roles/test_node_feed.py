"""A node's records read once (elastic/roles/node_feed.py) on a real etcd and a real relay
socket: a worker's subscription through its agent delivers exactly what a watch of its own
(`watch_from_now`, the reference) delivers, events and revisions alike, including values that are
not UTF-8; the agent watches each prefix once whatever the number of subscribers (etcd's own
watcher count); a worker that never reads delays nobody; when the relay goes, a subscription goes
on from etcd with nothing lost or repeated; with no relay a worker watches etcd itself; and a
subscription is not a worker to the relay's batches. A worker's prefixes share one connection."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request
import uuid
from typing import Any

import pytest

from elastic.coordinator import EtcdServer
from elastic.coordinator.watch import WatchEvent, watch_from_now
from elastic.roles.node_feed import FeedConnection, subscriber
from elastic.roles.node_relay import NodeRelay, RelayClient
from tests.polling import wait_for

pytestmark = pytest.mark.timeout(60)

Seen = list[tuple[str, str, bytes, int]]


def _name() -> str:
    return f"test-feed-{uuid.uuid4().hex[:10]}"


class _Log:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen: Seen = []

    def __call__(self, events: list[WatchEvent]) -> None:
        with self.lock:
            self.seen += [(ev.kind, ev.key, ev.value, ev.revision) for ev in events]

    def get(self) -> Seen:
        with self.lock:
            return list(self.seen)


def _watchers(server: EtcdServer) -> int:
    with urllib.request.urlopen(f"http://{server.endpoint}/metrics", timeout=10.0) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("etcd_debugging_mvcc_watcher_total "):
                return int(float(line.split()[1]))
    raise AssertionError("no watcher count in etcd's metrics")


def test_a_subscription_delivers_what_a_watch_of_its_own_does(
    etcd_server: EtcdServer, client: Any, job: str
) -> None:
    halts, decisions = f"/{job}/halt/", f"/{job}/decisions/"
    client.put(halts + "1", b'{"g": 1}')
    client.put(halts + "2", b"\xff\xfe not utf-8 \x00")
    client.put(f"/{job}/elsewhere", b"x")
    relay = NodeRelay(client, name=_name(), workers=3)
    reference = {p: _Log() for p in (halts, decisions)}
    ref_watches = [watch_from_now(client, p, log) for p, log in reference.items()]
    assert all(w.wait_ready(10.0) for w in ref_watches)
    before = _watchers(etcd_server)
    workers = [FeedConnection(client, relay.name) for _ in range(3)]  # a connection a worker
    logs = [{p: _Log() for p in reference} for _ in workers]
    subs = [w.subscribe(p, log) for w, wl in zip(workers, logs, strict=True) for p, log in wl.items()]
    try:
        assert all(wl[p].get() == reference[p].get() for wl in logs for p in reference)  # on return
        wait_for(lambda: _watchers(etcd_server) == before + 2, 10.0, "the agent's watches")
        time.sleep(0.3)
        assert _watchers(etcd_server) == before + 2  # one watch a prefix for the node's three workers
        assert sum(1 for t in threading.enumerate() if t.name == "feed-read") == 3  # one a worker
        client.put(halts + "3", b'{"g": 3}')
        client.put(decisions + "1/7", "commit")
        client.delete(halts + "1")
        client.put(halts + "2", bytes(range(256)))
        wait_for(lambda: len(reference[halts].get()) == 5 and len(reference[decisions].get()) == 1, 10.0,
                 "the reference watches")
        for wl in logs:
            wait_for(lambda wl=wl: len(wl[halts].get()) >= 5 and len(wl[decisions].get()) >= 1, 10.0, "a worker")
        time.sleep(0.2)  # room for a stray or repeated event to show
        assert all(wl[p].get() == reference[p].get() for wl in logs for p in reference)
        late = _Log()  # a worker that subscribes later gets what is there then
        subs.append(FeedConnection(client, relay.name).subscribe(halts, late))
        assert [(k, key, v) for k, key, v, _ in late.get()] == [("put", halts + "3", b'{"g": 3}'),
                                                                ("put", halts + "2", bytes(range(256)))]
        with pytest.raises(ValueError, match="already followed"):
            workers[0].subscribe(halts, _Log())
    finally:
        for sub in subs:
            sub.cancel()
        for w in ref_watches:
            w.cancel()
        relay.close()


def test_a_worker_that_never_reads_delays_nobody(client: Any, job: str) -> None:
    prefix = f"/{job}/plan/"
    relay = NodeRelay(client, name=_name(), workers=2)
    stuck = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # subscribes, then never reads (SIGSTOP)
    stuck.connect("\0" + relay.name)
    stuck.sendall(b'{"watch": "' + prefix.encode() + b'"}\n')
    log = _Log()
    feed = FeedConnection(client, relay.name).subscribe(prefix, log)
    try:
        big = b"p" * (1 << 20)  # 8 MB in all: far past the stuck socket's buffers
        for g in range(8):
            client.put(f"{prefix}{g}", big)
        wait_for(lambda: len(log.get()) == 8, 20.0, "every record past a stuck subscriber")
    finally:
        feed.cancel()
        stuck.close()
        relay.close()


def test_when_the_relay_goes_the_subscription_goes_on_from_etcd(client: Any, job: str) -> None:
    prefix = f"/{job}/decisions/"
    relay = NodeRelay(client, name=_name(), workers=1)
    log, reference = _Log(), _Log()
    ref_watch = watch_from_now(client, prefix, reference)
    feed = FeedConnection(client, relay.name).subscribe(prefix, log)
    try:
        client.put(prefix + "1/5", "commit")
        wait_for(lambda: len(log.get()) == 1, 10.0, "the first decision through the relay")
        relay.close()
        client.put(prefix + "1/6", "commit")  # while the subscription falls back, or after
        client.put(prefix + "1/5", "abort")
        wait_for(lambda: len(reference.get()) == 3, 10.0, "the reference watch")
        wait_for(lambda: len(log.get()) >= 3, 10.0, "the decisions after the relay went")
        time.sleep(0.2)
        assert log.get() == reference.get()
    finally:
        feed.cancel()
        ref_watch.cancel()


def test_without_a_relay_a_worker_watches_etcd_itself(client: Any, job: str) -> None:
    prefix = f"/{job}/halt/"
    client.put(prefix + "1", "h1")
    log = _Log()
    watch = subscriber(client, _name())(prefix, log)  # a relay name nobody serves
    try:
        client.put(prefix + "2", "h2")
        wait_for(lambda: [key for _, key, _, _ in log.get()] == [prefix + "1", prefix + "2"], 10.0, "both halts")
    finally:
        watch.cancel()


def test_a_subscription_is_not_a_worker_to_the_batches(client: Any, job: str) -> None:
    """Two subscriptions open and close; the relay still waits for both of its workers' puts
    (a closed subscription counted as a gone worker would flush the first put alone)."""
    relay = NodeRelay(client, name=_name(), workers=2, linger_s=30.0)
    try:
        for _ in range(2):
            FeedConnection(client, relay.name).subscribe(f"/{job}/halt/", _Log()).cancel()
        done: list[float] = []
        first = threading.Thread(target=lambda: (RelayClient(relay.name).put([(f"/{job}/a", "1", None)]),
                                                 done.append(time.monotonic())))
        first.start()
        time.sleep(1.0)
        assert not done, "the first worker's put was written without waiting for the second"
        RelayClient(relay.name).put([(f"/{job}/b", "2", None)])
        first.join(10.0)
        assert done and relay.transactions == 1
    finally:
        relay.close()
