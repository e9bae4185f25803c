"""Soak (`pytest -m soak tests/faults/test_soak.py -s`): one long run of tiny on 5 nodes, f = 1,
with a seeded random schedule of faults (kill, hang, partition, slow; soak.py), each failed
node rejoining as a new incarnation before the next fault.

Asserts: every step committed exactly once and in order (by one generation, each worker's local
step log increasing); no survivor's worker restarted; the
final state and every loss equal the failure-free run's; every fault's request is done (or
fenced, for a partition) and every rejoin done; every failing fault is one recovery of the
summary (its node lost, timed from that very fault) and every rejoin one generation taking the
node back in; slow-downs cost no node. Prints the fault log and the recovery totals.

Knobs: ELASTIC_SOAK_FAULTS (default 30), ELASTIC_SOAK_SEED (default 0), ELASTIC_SOAK_STEPS
(default 80 per fault + 60: the run must outlast the schedule; a fault cycle took 27 to 31
steps before the control plane's CPU cost was cut, and about 40 on average after it, up to
~100 for a hang or a partition found by lease expiry).
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import pytest

from elastic.coordinator import EtcdServer
from elastic.records.injection import read_statuses

from .runs import LiveJob, check_same_training, static_reference, step_logs, tiny_config
from .soak import SoakController, soak_schedule

FAULTS = int(os.environ.get("ELASTIC_SOAK_FAULTS", "30"))
SEED = int(os.environ.get("ELASTIC_SOAK_SEED", "0"))
STEPS = int(os.environ.get("ELASTIC_SOAK_STEPS", str(80 * FAULTS + 60)))
NODES = 5
LEASE_TTL = 3


def test_schedule_is_seeded_and_covers_every_kind() -> None:
    a = soak_schedule(FAULTS, seed=SEED, lease_ttl=LEASE_TTL)
    assert a == soak_schedule(FAULTS, seed=SEED, lease_ttl=LEASE_TTL) and len(a) == FAULTS
    assert {f.kind for f in a} == {"kill", "hang", "partition", "slow"} or FAULTS < 4
    assert all(f.seconds > LEASE_TTL for f in a if f.kind == "partition" and f.seconds is not None)


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_soak(etcd_server: EtcdServer, tmp_path: Path) -> None:
    schedule = soak_schedule(FAULTS, seed=SEED, lease_ttl=LEASE_TTL)
    config = tiny_config(tmp_path / "soak", nodes=NODES, pipelines=2, steps=STEPS, lease_ttl=LEASE_TTL)
    print(
        f"\nsoak: {FAULTS} faults (seed {SEED}), {STEPS} steps on {NODES} nodes, f=1, lease TTL {LEASE_TTL} s"
    )
    started = time.monotonic()
    job = LiveJob(config, etcd=etcd_server.endpoint, timeout_s=3000.0).start()
    try:
        job.wait_committed(2)
        log = SoakController(job, steps=STEPS).run(schedule)
        faults_s = time.monotonic() - started
        summary, state = job.result()
        client, keys, rk = job.client, job.keys, job.rk
        statuses = read_statuses(client, keys.root)
        injected = {m.key.decode().rsplit("/", 1)[1]: float(v) for v, m in client.get_prefix(rk.injected(""))}
        # Every pipeline's first worker logs each step it committed, with the committing generation.
        logs = step_logs(Path(config.spec.run_dir))
        commits: dict[int, set[int]] = {}
        for results in logs.values():
            for r in results:
                commits.setdefault(r.step, set()).add(r.generation)
    finally:
        job.close()
    wall_s = time.monotonic() - started

    # Every step committed exactly once, in order.
    assert sorted(commits) == list(range(STEPS)), "steps never committed: " + str(
        set(range(STEPS)) - set(commits)
    )
    twice = {s: g for s, g in commits.items() if len(g) != 1}
    assert twice == {}, f"steps committed in more than one generation: {twice}"
    generations = [min(commits[s]) for s in range(STEPS)]
    assert generations == sorted(generations), "a step committed by an older generation than the one before it"
    for name, results in logs.items():
        steps = [r.step for r in results]
        assert all(a < b for a, b in zip(steps, steps[1:], strict=False)), f"{name}: steps out of order: {steps}"

    # Every fault carried out; every failing one a recovery timed from it; every rejoin taken in.
    recoveries = summary.recoveries
    for entry in log:
        st = statuses[entry.request]
        assert st.state in (("done", "fenced") if entry.fault.kind == "partition" else ("done",)), (
            entry.line(),
            st,
        )
        if entry.fault.kind == "slow":
            continue
        assert entry.rejoin is not None and statuses[entry.rejoin].state == "done", entry.line()
        (rec,) = [r for r in recoveries if r["generation"] == entry.lost_in]
        assert rec["lost_nodes"] == [entry.node] and not rec["interrupted"], (entry.line(), rec)
        assert rec["fault_at"] == injected[entry.request], (entry.line(), rec)
        (back,) = [r for r in recoveries if r["generation"] == entry.rejoined_in]
        assert back["joined_nodes"] == [entry.node] and back["lost_nodes"] == [], (entry.line(), back)
    failing = [e for e in log if e.fault.kind != "slow"]
    lost = [r for r in recoveries if r["lost_nodes"]]
    assert len(lost) == len(failing), (
        f"{len(lost)} losses for {len(failing)} failing faults (a false failure?)"
    )
    assert len(recoveries) == 2 * len(failing), [(r["generation"], r["reason"]) for r in recoveries]

    ref_started = time.monotonic()
    reference = static_reference(tmp_path / "reference", steps=STEPS)
    reference_s = time.monotonic() - ref_started
    check_same_training(summary, state, reference, steps=STEPS)

    print("\nsoak fault log:")
    for entry in log:
        print("  " + entry.line())
    kinds = {k: sum(1 for e in log if e.fault.kind == k) for k in ("kill", "hang", "partition", "slow")}
    print(f"soak: {len(log)} faults {kinds}, {len(recoveries)} recoveries, {STEPS} steps, "
          f"faults done after {faults_s:.0f} s, run {wall_s:.0f} s, failure-free reference {reference_s:.0f} s")
    for kind in ("kill", "hang", "partition"):
        totals = [
            r["total_s"]
            for e in log
            if e.fault.kind == kind
            for r in recoveries
            if r["generation"] == e.lost_in
        ]
        detect = [r["detecting_s"] for e in log if e.fault.kind == kind for r in recoveries
                  if r["generation"] == e.lost_in]
        if totals:
            print(f"  {kind:<9} recovery total median {statistics.median(totals):.2f} s max {max(totals):.2f} s, "
                  f"detection median {statistics.median(detect):.2f} s")
    # A join generation that the next fault superseded before it trained has no total.
    joins = [r["total_s"] for r in recoveries if r["joined_nodes"] and not r["interrupted"]]
    cut = sum(1 for r in recoveries if r["joined_nodes"] and r["interrupted"])
    if joins:
        print(f"  rejoin    recovery total median {statistics.median(joins):.2f} s max {max(joins):.2f} s"
              f"{f', {cut} superseded by the next fault before training' if cut else ''}")
