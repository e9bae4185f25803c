"""Failure detection on real processes: SIGKILL a worker, SIGSTOP a node, kill the etcd launcher."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import psutil
import pytest

from elastic.coordinator import JobKeys, Membership, MembershipConfig, NodeIdentity

from .support import REPO, Members, wait_for

TTL = 2


def _loss_time(members: Members, observer: str, node: str) -> float | None:
    for rec in members.records(observer):
        if rec["event"] == "loss" and rec["node"] == node:
            return float(rec["t"])
    return None


@pytest.mark.timeout(90)
def test_sigkill_worker_every_member_sees_loss_under_1s(members: Members) -> None:
    members.start("n0", "agent", ttl=TTL)
    for n in ("n1", "n2"):
        members.start(n, ttl=TTL)
    members.wait_ready("n0", "n1", "n2")
    worker = next(r["pid"] for r in members.records("n0") if r["event"] == "worker")
    t0 = time.monotonic()
    os.kill(worker, signal.SIGKILL)
    for observer in ("n1", "n2"):
        seen = wait_for(lambda o=observer: _loss_time(members, o, "n0"), 5.0, f"{observer} sees n0 lost")
        assert seen - t0 < 1.0, f"{observer} saw the loss {seen - t0:.3f} s after SIGKILL"
    # Only n0 was lost: the survivors never saw each other go.
    for observer in ("n1", "n2"):
        assert {r["node"] for r in members.records(observer) if r["event"] == "loss"} == {"n0"}


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_sigstop_node_is_lost_within_ttl_plus_1s(members: Members) -> None:
    members.start("n0", ttl=TTL)
    members.start("n1", ttl=TTL)
    members.wait_ready("n0", "n1")
    t0 = time.monotonic()
    os.kill(members.procs["n1"].pid, signal.SIGSTOP)
    try:
        seen = wait_for(lambda: _loss_time(members, "n0", "n1"), TTL + 5.0, "n0 sees n1 lost")
    finally:
        os.kill(members.procs["n1"].pid, signal.SIGCONT)
    assert seen - t0 < TTL + 1.0, f"hung node lost after {seen - t0:.3f} s, want < {TTL + 1}"


@pytest.mark.timeout(60)
def test_etcd_dies_with_its_launcher() -> None:
    launcher = subprocess.Popen(
        [sys.executable, "-m", "elastic.coordinator.etcd_server"],
        stdout=subprocess.PIPE,
        cwd=REPO,
    )
    try:
        assert launcher.stdout is not None
        endpoint = launcher.stdout.readline().decode().strip()
        assert endpoint.startswith("127.0.0.1:")
        children = psutil.Process(launcher.pid).children()
        assert len(children) == 1 and "etcd" in children[0].name()
        etcd_pid = children[0].pid
        launcher.kill()  # SIGKILL: no atexit, no signal handler runs
        launcher.wait()
        wait_for(lambda: not psutil.pid_exists(etcd_pid) or psutil.Process(etcd_pid).status() == "zombie",
                 5.0, "etcd to die with its launcher")
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


@pytest.mark.timeout(30)
def test_suspicion_is_confirmed_only_through_etcd(client: Any, job: str) -> None:
    keys = JobKeys(job)
    a = Membership(client, keys, NodeIdentity(node_id="a", incarnation=0, address="h:1", devices=1),
                   config=MembershipConfig(ttl=TTL))
    b = Membership(client, keys, NodeIdentity(node_id="b", incarnation=0, address="h:2", devices=1),
                   config=MembershipConfig(ttl=TTL))
    a.join()
    b.join()
    try:
        # b is alive: a collective error alone does not make it lost.
        assert not a.confirm_loss("b", 0, reason="all_reduce timed out", timeout=0.5)
        assert set(a.members()) == {"a", "b"}
        # b's agent reports its own failure: the suspicion is now confirmed, at once.
        assert b.report_failure(reason="worker died")
        t0 = time.monotonic()
        assert a.confirm_loss("b", 0, reason="all_reduce failed")
        assert time.monotonic() - t0 < 0.5
        assert not a.report_failure("b", 0, reason="late report")  # already gone
    finally:
        a.leave()
        b.leave()
