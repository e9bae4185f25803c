"""`progress.recovery_breakdown` finds the fault that caused each recovery (real etcd, no processes).

A node failed, rejoined and failed again has several carried-out injections: a recovery's
`fault_at` is the latest fault into a lost node at or before the generation's detection, not
the first one of the run (and never the node's rejoin).
"""

from __future__ import annotations

from typing import Any

from elastic.coordinator import JobKeys
from elastic.coordinator.keys import RunKeys
from elastic.records.generation import GenerationRecord
from elastic.records.recoveries import fault_time, recovery_breakdown
from elastic.records.recovery_timings import ReconfigTimings, RecoveryTimings
from templates.plan import even_plan

T0 = 1_000_000.0


def record(*, lost: list[int], detected_at: float, nodes: list[int]) -> GenerationRecord:
    plan = even_plan(num_layers=6, nodes=nodes, num_pipelines=1, global_microbatches=4, microbatch_size=2,
                     fault_tolerance=0)
    return GenerationRecord(plan=plan, resume_step=3, incarnations=dict.fromkeys(nodes, 0), lost=lost,
                            detected_at=detected_at, published_at=detected_at + 0.5)


def timings(first_commit_at: float) -> list[RecoveryTimings]:
    return [RecoveryTimings(ranks=[0], seen_at=first_commit_at - 2, reconfig=ReconfigTimings(transfer_s=0.1, rebuild_s=0.2,
                            bytes_fetched=10), started_at=first_commit_at - 1, first_commit_at=first_commit_at)]


def test_fault_time_takes_the_latest_fault_before_the_detection() -> None:
    carried = [("kill-node2-step3", T0), ("rejoin-node2-step6", T0 + 10), ("hang-node2-now-ab12cd", T0 + 20),
               ("kill-node12-step9", T0 + 25), ("partition-node2-now-0f0f0f", T0 + 40)]
    assert fault_time(carried, 2, detected=T0 + 5) == T0
    assert fault_time(carried, 2, detected=T0 + 15) == T0  # a rejoin is no fault
    assert fault_time(carried, 2, detected=T0 + 24) == T0 + 20
    assert fault_time(carried, 2, detected=T0 + 41) == T0 + 40
    assert fault_time(carried, 1, detected=T0 + 41) is None  # node 12 is not node 1
    assert fault_time(carried, 2, detected=T0 - 1) is None


def test_repeated_faults_on_a_node_each_start_their_own_recovery(client: Any, job: str) -> None:
    rk = RunKeys(JobKeys(job))
    # node 2 killed at T0, rejoins, hung at T0+30 (lost at T0+33, a TTL later), rejoins, killed at T0+60.
    for name, at in [("kill-node2-step3", T0), ("rejoin-node2-step5", T0 + 10),
                     ("hang-node2-step12", T0 + 30), ("rejoin-node2-step15", T0 + 40),
                     ("kill-node2-now-a1b2c3", T0 + 60), ("kill-node1-step4", T0 + 0.5)]:
        client.put(rk.injected(name), repr(at))
    nodes = [0, 1, 3]
    first = recovery_breakdown(
        client, rk, 2, record(lost=[2], detected_at=T0 + 0.2, nodes=nodes), timings(T0 + 3)
    )
    second = recovery_breakdown(
        client, rk, 4, record(lost=[2], detected_at=T0 + 33, nodes=nodes), timings(T0 + 36)
    )
    third = recovery_breakdown(client, rk, 6, record(lost=[2], detected_at=T0 + 60.1, nodes=nodes),
                               timings(T0 + 62))
    assert (first["fault_at"], second["fault_at"], third["fault_at"]) == (T0, T0 + 30, T0 + 60)
    assert abs(second["detecting_s"] - 3.0) < 1e-6 and abs(second["total_s"] - 6.0) < 1e-6
    # Two nodes lost together: the recovery runs from the earlier of their faults.
    both = recovery_breakdown(
        client, rk, 2, record(lost=[1, 2], detected_at=T0 + 1, nodes=[0, 3]), timings(T0 + 4)
    )
    assert both["fault_at"] == T0
    # A loss with no injected fault (a real crash) runs from its detection.
    real = recovery_breakdown(
        client, rk, 3, record(lost=[3], detected_at=T0 + 50, nodes=[0, 1]), timings(T0 + 52)
    )
    assert real["fault_at"] == T0 + 50 and real["detecting_s"] == 0.0
