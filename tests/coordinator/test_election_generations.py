"""Leader election and generations: leader kill, CAS under concurrent writers, committed step."""

from __future__ import annotations

import json
import signal
import threading
import time
from typing import Any

import pytest

from elastic.coordinator import (
    EtcdConfig,
    EtcdServer,
    Generation,
    GenerationConflict,
    Generations,
    JobKeys,
    LeaderElection,
    connect,
    current_leader,
)

from .support import Members, wait_for

TTL = 2


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_leader_sigkill_new_leader_within_ttl_plus_1s(members: Members, client: Any, job: str) -> None:
    for n in ("c0", "c1", "c2"):
        members.start(n, "candidate", ttl=TTL)
    members.wait_ready("c0", "c1", "c2")
    keys = JobKeys(job)
    leader = wait_for(lambda: current_leader(client, keys), 10.0, "a first leader")
    t0 = time.monotonic()
    members.procs[leader].send_signal(signal.SIGKILL)
    new = wait_for(lambda: (current_leader(client, keys) or leader) != leader and current_leader(client, keys),
                   TTL + 5.0, "a new leader")
    elapsed = time.monotonic() - t0
    assert new in {"c0", "c1", "c2"} - {leader}
    assert elapsed < TTL + 1.0, f"new leader after {elapsed:.3f} s, want < {TTL + 1}"


@pytest.mark.timeout(60)
def test_deposed_leader_cannot_publish(etcd_server: EtcdServer, client: Any, job: str) -> None:
    keys = JobKeys(job)
    a = LeaderElection(client, keys, "a", ttl=TTL).start()
    assert a.wait_leader(5.0)
    gens = Generations(client, keys)
    gens.publish('{"p": 1}', expected=0, fence=a.leader_compare())
    b = LeaderElection(connect(EtcdConfig(endpoint=etcd_server.endpoint)), keys, "b", ttl=TTL).start()
    fence_a = a.leader_compare()
    a.resign()
    assert b.wait_leader(5.0)
    with pytest.raises(GenerationConflict):
        gens.publish('{"p": "stale"}', expected=1, fence=fence_a)
    assert gens.publish('{"p": 2}', expected=1, fence=b.leader_compare()).number == 2
    b.resign()


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_generations_strictly_increasing_one_plan_each_under_concurrent_writers(
    etcd_server: EtcdServer, client: Any, job: str
) -> None:
    keys = JobKeys(job)
    seen: list[Generation] = []
    watch = Generations(client, keys).watch(seen.append, after=0)
    assert watch.wait_ready(5.0)
    wins: dict[int, str] = {}
    conflicts = [0]
    lock = threading.Lock()
    stop = time.monotonic() + 3.0

    def writer(w: int) -> None:
        gens = Generations(connect(EtcdConfig(endpoint=etcd_server.endpoint)), keys)
        i = 0
        while time.monotonic() < stop:
            base = gens.current_number()
            plan = json.dumps({"writer": w, "attempt": i})
            i += 1
            try:
                gen = gens.publish(plan, expected=base)
            except GenerationConflict:
                with lock:
                    conflicts[0] += 1
                continue
            with lock:
                assert gen.number not in wins, f"generation {gen.number} published twice"
                wins[gen.number] = plan

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    final = Generations(client, keys).current_number()
    assert sorted(wins) == list(range(1, final + 1)), "every generation 1..g won by exactly one writer"
    assert conflicts[0] > 0, "the writers did not actually race"
    for number, plan in wins.items():
        value, meta = client.get(keys.plan(number))
        assert value.decode() == plan and meta.version == 1, f"plan {number} rewritten"
    wait_for(lambda: len(seen) == final, 5.0, "the watch to deliver every generation")
    watch.cancel()
    assert [g.number for g in seen] == list(range(1, final + 1))
    assert all(g.plan == wins[g.number] for g in seen)
