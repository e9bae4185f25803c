"""Soak (`pytest -m soak tests/faults/test_soak.py -s`): one long run of tiny on 5 nodes, f = 1,
on a 3-member etcd cluster, with a seeded random schedule of faults (kill, hang, partition,
slow, etcd member kill, > f nodes at once; soak.py), each failed node rejoining as a new
incarnation before the next fault.

Asserts: every step committed exactly once and in order (by one generation, each worker's local
step log increasing; a step that a checkpoint fallback rolled back once more, by the fallback's
generation or a later one); every fallback fault answered by a checkpoint fallback; etcd member
kills cost no generation; no survivor's worker restarted; the
final state and every loss equal the failure-free run's; every fault's request is done (or
fenced, for a partition) and every rejoin done; every failing fault is one recovery of the
summary (its node lost, timed from that very fault) and every rejoin one generation taking the
node back in; slow-downs cost no node. Prints the fault log and the recovery totals.

Knobs: ELASTIC_SOAK_FAULTS (default 30; from 30 on at least 2 etcd member kills and 1 fallback), ELASTIC_SOAK_SEED (default 0), ELASTIC_SOAK_STEPS
(default 80 per fault + 60: the run must outlast the schedule; a fault cycle took 27 to 31
steps before the control plane's CPU cost was cut, and about 40 on average after it, up to
~100 for a hang or a partition found by lease expiry).
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import time
from pathlib import Path

import pytest

from elastic.coordinator.etcd_cluster import EtcdCluster
from elastic.records.injection_requests import read_statuses

from .runs import LiveJob, check_same_training, static_reference, step_logs, tiny_config
from .soak import FAULT_KINDS, GUARANTEED_AT, SoakController, check_exactly_once, soak_schedule

FAULTS = int(os.environ.get("ELASTIC_SOAK_FAULTS", "30"))
SEED = int(os.environ.get("ELASTIC_SOAK_SEED", "0"))
STEPS = int(os.environ.get("ELASTIC_SOAK_STEPS", str(80 * FAULTS + 60)))
NODES = 5
ETCD_MEMBERS = 3
LEASE_TTL = 3


def test_schedule_is_seeded_and_covers_every_kind() -> None:
    a = soak_schedule(FAULTS, seed=SEED, lease_ttl=LEASE_TTL)
    assert a == soak_schedule(FAULTS, seed=SEED, lease_ttl=LEASE_TTL) and len(a) == FAULTS
    assert {f.kind for f in a} >= {"kill", "hang", "partition", "slow"} or FAULTS < 4
    assert {f.kind for f in a} == set(FAULT_KINDS) or len(FAULT_KINDS) > FAULTS
    assert all(f.seconds > LEASE_TTL for f in a if f.kind == "partition" and f.seconds is not None)


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_thirty_faults_hold_two_member_kills_and_a_fallback(seed: int) -> None:
    kinds = [f.kind for f in soak_schedule(GUARANTEED_AT, seed=seed, lease_ttl=LEASE_TTL)]
    assert kinds.count("etcd") >= 2 and kinds.count("fallback") >= 1, kinds
    assert soak_schedule(GUARANTEED_AT, seed=seed, lease_ttl=LEASE_TTL) != soak_schedule(
        GUARANTEED_AT, seed=seed + 1, lease_ttl=LEASE_TTL)


def dump_stacks(run_dir: Path) -> None:
    """Every agent and worker of the job writes its threads' stacks to its log (SIGUSR1); the
    logs stay in the run directory, named here."""
    import psutil

    roles = ("elastic.roles.agent", "elastic.roles.elastic_worker")
    procs = [p for p in psutil.process_iter()  # forked from a warm parent: not all of them our descendants
             if any(r in " ".join(p.cmdline()) for r in roles)]
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGUSR1)
    time.sleep(1.0)
    print(f"\nsoak failed: stacks of {len(procs)} agents and workers written to their logs in {run_dir / 'logs'}")


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_soak(tmp_path: Path) -> None:
    schedule = soak_schedule(FAULTS, seed=SEED, lease_ttl=LEASE_TTL)
    config = tiny_config(tmp_path / "soak", nodes=NODES, pipelines=2, steps=STEPS, lease_ttl=LEASE_TTL)
    print(
        f"\nsoak: {FAULTS} faults (seed {SEED}), {STEPS} steps on {NODES} nodes, f=1, lease TTL {LEASE_TTL} s"
    )
    started = time.monotonic()
    cluster = EtcdCluster(ETCD_MEMBERS, data_dir=tmp_path / "etcd").start()
    job = LiveJob(config, etcd=cluster.endpoint, timeout_s=3000.0).start()
    try:
        job.wait_committed(2)
        try:
            log = SoakController(job, steps=STEPS, cluster=cluster).run(schedule)
        except BaseException:
            dump_stacks(Path(config.spec.run_dir))
            raise
        faults_s = time.monotonic() - started
        summary, state = job.result()
        client, keys, rk = job.client, job.keys, job.rk
        statuses = read_statuses(client, keys.root)
        injected = {m.key.decode().rsplit("/", 1)[1]: float(v) for v, m in client.get_prefix(rk.injected(""))}
        # Every pipeline's first worker logs each step it committed, with the committing generation.
        logs = step_logs(Path(config.spec.run_dir))
    finally:
        job.close()
        cluster.close()
    wall_s = time.monotonic() - started

    # Every step committed exactly once, in order (once more after a checkpoint fallback).
    recoveries = summary.recoveries
    fallbacks = {int(r["generation"]): int(r["restore_checkpoint"]) for r in recoveries
                 if r["restore_checkpoint"] is not None}
    check_exactly_once(logs, fallbacks, STEPS)

    # etcd member kills: no generation; > f losses: one checkpoint fallback among their generations.
    for entry in log:
        if entry.fault.kind == "etcd":
            assert entry.status == "done", entry.line()
        if entry.fault.kind == "fallback":
            assert all(statuses[r].state == "done" for r in entry.requests), entry.line()
            assert set(entry.lost_gens) & set(fallbacks), (entry.line(), fallbacks)
            assert {n for r in recoveries if r["generation"] in entry.lost_gens for n in r["lost_nodes"]} == set(
                entry.nodes), entry.line()
            assert {n for r in recoveries if r["generation"] in entry.rejoined_gens for n in r["joined_nodes"]} == set(
                entry.nodes), entry.line()
    assert set(fallbacks) <= {g for e in log if e.fault.kind == "fallback" for g in e.lost_gens}, (
        f"a checkpoint fallback no fault asked for: {fallbacks}")

    # Every fault carried out; every failing one a recovery timed from it; every rejoin taken in.
    for entry in log:
        if entry.fault.kind in ("etcd", "fallback"):
            continue
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
    failing = [e for e in log if e.fault.kind not in ("slow", "etcd", "fallback")]
    over_f = [e for e in log if e.fault.kind == "fallback"]
    lost = [r for r in recoveries if r["lost_nodes"]]
    assert len(lost) == len(failing) + sum(len(e.lost_gens) for e in over_f), (
        f"{len(lost)} losses for {len(failing)} failing faults and {len(over_f)} fallbacks (a false failure?)"
    )
    assert len(recoveries) == 2 * len(failing) + sum(len(e.lost_gens) + len(e.rejoined_gens) for e in over_f), [
        (r["generation"], r["reason"]) for r in recoveries]

    ref_started = time.monotonic()
    reference = static_reference(tmp_path / "reference", steps=STEPS)
    reference_s = time.monotonic() - ref_started
    check_same_training(summary, state, reference, steps=STEPS)

    print("\nsoak fault log:")
    for entry in log:
        print("  " + entry.line())
    kinds = {k: sum(1 for e in log if e.fault.kind == k) for k in FAULT_KINDS}
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


def test_exactly_once_allows_only_a_fallbacks_rollback() -> None:
    from types import SimpleNamespace as R

    # Steps 0-7 by generation 1, a fallback (generation 2) to checkpoint 5, steps 5-9 by it.
    log = [R(step=s, generation=1) for s in range(8)] + [R(step=s, generation=2) for s in range(5, 10)]
    check_exactly_once({"a": log}, {2: 5}, 10)
    with pytest.raises(AssertionError, match="no fallback"):
        check_exactly_once({"a": log}, {}, 10)  # the same rewind with no fallback generation
    with pytest.raises(AssertionError, match="no fallback"):
        check_exactly_once({"a": log}, {2: 7}, 10)  # rewound past the checkpoint
    with pytest.raises(AssertionError, match="never committed"):
        check_exactly_once({"a": log[:-1]}, {2: 5}, 10)
    twice = [R(step=s, generation=1) for s in range(10)]
    with pytest.raises(AssertionError, match="no fallback"):
        check_exactly_once({"a": twice, "b": [R(step=3, generation=2)]}, {}, 10)  # another log, a later generation
