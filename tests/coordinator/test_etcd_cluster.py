"""A client of a 3-member etcd cluster does not notice the loss of a member: unary calls fail
over within the 5 s retry budget, a watch on the lost member resumes on another without a gap,
a kept lease (and its key) survives the loss of the leader, and a killed member rejoins with its
data. The same calls on a single endpoint are the reference (they fail while it is down)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import etcd3.exceptions
import psutil
import pytest

from elastic.coordinator import EtcdConfig, connect
from elastic.coordinator.client import etcd_unreachable
from elastic.coordinator.etcd_cluster import EtcdCluster
from elastic.coordinator.lease import KeptLease
from elastic.coordinator.watch import PrefixWatch, WatchEvent

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


@pytest.fixture
def cluster(tmp_path: Path) -> EtcdCluster:
    with EtcdCluster(3, data_dir=tmp_path / "etcd") as c:
        yield c


def test_unary_calls_ride_out_the_leader_kill(cluster: EtcdCluster) -> None:
    client = connect(EtcdConfig(endpoint=cluster.endpoint))
    # The reference: a client of the leader member alone cannot put while it is down.
    leader = cluster.leader()
    alone = connect(EtcdConfig(endpoint=cluster.endpoints[leader], retry_s=1.0))
    try:
        client.put("/ha/k", "0")
        cluster.kill(leader)
        killed_at = time.monotonic()
        slowest = 0.0
        for i in range(1, 21):
            t = time.monotonic()
            client.put("/ha/k", str(i))
            slowest = max(slowest, time.monotonic() - t)
        assert client.get("/ha/k")[0] == b"20"
        assert slowest < 5.0, f"a put took {slowest:.2f} s: past the retry budget"
        with pytest.raises(etcd3.exceptions.Etcd3Exception):
            alone.put("/ha/k", "x")
        new_leader = cluster.leader()
        assert new_leader != leader
        print(f"20 puts {time.monotonic() - killed_at:.2f} s after the leader kill, slowest {slowest:.2f} s")
        # The killed member rejoins with its data dir and catches up.
        cluster.restart(leader)
        assert alone.get("/ha/k")[0] == b"20"
    finally:
        alone.close()
        client.close()


def test_a_watch_survives_the_loss_of_its_member(cluster: EtcdCluster) -> None:
    client = connect(EtcdConfig(endpoint=cluster.endpoint))
    writer = connect(EtcdConfig(endpoint=cluster.endpoint))
    seen: list[int] = []
    lock = threading.Lock()

    def on_events(events: list[WatchEvent]) -> None:
        with lock:
            seen.extend(int(ev.value) for ev in events if ev.kind == "put")

    watch = PrefixWatch(client, "/ha/w/", on_events)
    try:
        assert watch.wait_ready(10.0)
        for i in range(10):
            writer.put(f"/ha/w/{i}", str(i))
        # Kill the member the watch streams from (the one its client uses).
        in_use = client.endpoint_in_use.netloc  # type: ignore[attr-defined]
        cluster.kill(cluster.endpoints.index(in_use))
        for i in range(10, 30):
            writer.put(f"/ha/w/{i}", str(i))
        deadline = time.monotonic() + 15.0
        while time.monotonic() < deadline and len(seen) < 30:
            time.sleep(0.05)
        with lock:
            assert seen == list(range(30)), f"the watch lost or repeated events: {seen}"
        assert client.endpoint_in_use.netloc != in_use  # type: ignore[attr-defined]
    finally:
        watch.cancel()
        client.close()
        writer.close()


def test_a_kept_lease_survives_the_leader_kill(cluster: EtcdCluster) -> None:
    client = connect(EtcdConfig(endpoint=cluster.endpoint))
    lease = KeptLease(client, 2, give_up_s=30.0)
    try:
        client.put("/ha/leased", "v", lease=lease.id)
        cluster.kill(cluster.leader())
        time.sleep(2 * 2 + 1.0)  # past twice the TTL
        assert not lease.lost.is_set(), lease.lost_reason
        assert client.get("/ha/leased")[0] == b"v", "the lease (and its key) did not survive"
    finally:
        lease.stop_refreshing()
        client.close()


def test_pause_and_resume_a_member(cluster: EtcdCluster) -> None:
    """SIGSTOP of one member of three: the cluster keeps its quorum and the client goes on."""
    client = connect(EtcdConfig(endpoint=cluster.endpoint))
    try:
        client.put("/ha/p", "0")
        member = cluster.endpoints.index(client.endpoint_in_use.netloc)  # type: ignore[attr-defined]
        cluster.pause(member)
        t = time.monotonic()
        client.put("/ha/p", "1")
        assert time.monotonic() - t < 5.0
        cluster.resume(member)
        assert client.get("/ha/p")[0] == b"1"
    finally:
        client.close()


def member_state(cluster: EtcdCluster, index: int) -> str:
    """The process state of member `index` ('stopped', 'sleeping', ...)."""
    pid = cluster.members[index].pid
    return "gone" if pid is None else psutil.Process(pid).status()


def stopped(cluster: EtcdCluster, members: list[int], timeout: float = 5.0) -> None:
    """Wait until every one of `members` is stopped (a SIGSTOP takes effect once every thread of
    the process leaves the kernel: one in a disk write finishes it first)."""
    deadline = time.monotonic() + timeout
    while any(member_state(cluster, i) != psutil.STATUS_STOPPED for i in members):
        assert time.monotonic() < deadline, f"members {members} not stopped: {[member_state(cluster, i) for i in members]}"
        time.sleep(0.01)


def test_calls_wait_out_a_lost_quorum(cluster: EtcdCluster) -> None:
    """SIGSTOP of two members of three: the third has no quorum and holds every linearizable
    call until the caller's deadline, then answers with a server-side timeout (status UNKNOWN,
    "context deadline exceeded") or no leader. Our client retries those; once the two are
    continued the call answers. The reference, a call that is not retried, fails the same way."""
    leader = cluster.leader()
    writer = connect(EtcdConfig(endpoint=cluster.endpoints[leader]))
    patient = connect(EtcdConfig(endpoint=cluster.endpoints[leader], timeout=1.0, retry_s=20.0))
    impatient = connect(EtcdConfig(endpoint=cluster.endpoints[leader], timeout=1.0, retry_s=0.0))
    followers = [i for i in range(3) if i != leader]
    try:
        writer.put("/ha/q", "before")
        for i in followers:
            cluster.pause(i)
        stopped(cluster, followers)
        paused_at = time.monotonic()
        with pytest.raises(Exception) as failed:
            impatient.get("/ha/q")
            raise AssertionError(  # diagnostics: this failed once in CI, on a busy machine
                f"a get was answered {time.monotonic() - paused_at:.2f} s after members {followers} stopped "
                f"(leader was {leader}; states {[member_state(cluster, i) for i in range(3)]})")
        assert not isinstance(failed.value, AssertionError), failed.value
        assert etcd_unreachable(failed.value), f"not recognised as etcd out of reach: {failed.value!r}"
        resumed_at: list[float] = []

        def resume() -> None:
            for i in followers:
                cluster.resume(i)
            resumed_at.append(time.monotonic())

        timer = threading.Timer(2.5, resume)
        timer.start()
        value, _ = patient.get("/ha/q")
        answered_at = time.monotonic()
        timer.join()
        assert value == b"before"
        assert answered_at > resumed_at[0], "answered while the quorum was lost"
        patient.put("/ha/q", "after")
        assert writer.get("/ha/q")[0] == b"after"
        print(f"reference failed with {type(failed.value).__name__}; the retried get answered "
              f"{answered_at - paused_at:.2f} s after the pause, {answered_at - resumed_at[0]:.2f} s after the resume")
    finally:
        for i in followers:
            cluster.resume(i)
        for c in (writer, patient, impatient):
            c.close()
