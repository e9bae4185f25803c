"""The leader's straggler decision (elastic/roles/straggler_decisions.py) as a table: policy x
(marks, measures, the split in force, a spare) -> nothing, a re-split, or a drain of the straggler.
Each expected plan is computed here from the options and the split functions, not read back."""

from __future__ import annotations

import dataclasses

import pytest

from elastic.planning.cluster import ClusterSpec, cluster_templates
from elastic.planning.stragglers import rebalanced
from elastic.records.generation import GenerationRecord
from elastic.records.stragglers import Mark, StragglerRecord
from elastic.roles.straggler_decisions import DrainStraggler, Resplit, straggler_decision
from templates.instantiation import instantiate

SPEC = ClusterSpec(model="tiny", nodes=4, fault_tolerance=1, global_batch=32, microbatch=2, device_memory_gib=0.03)
TSET = cluster_templates(dataclasses.replace(SPEC, fault_tolerance=0))
PLAN = instantiate(TSET, [0, 1, 2, 3], global_microbatches=16, fault_tolerance=1)  # [(0, 1), (2, 3)], 8 + 8
SLOW = {0: 0.1, 1: 0.1, 2: 0.1, 3: 0.2}
EVEN = {0: 0.1, 1: 0.1, 2: 0.1, 3: 0.1}
MARK = {3: Mark(since_step=40, since=0.0, factor=2.0)}
SPLIT_FOR_3 = dataclasses.replace(PLAN, pipelines=tuple(
    dataclasses.replace(p, microbatches=m) for p, m in zip(PLAN.pipelines, (11, 5), strict=True)))


def _record(plan: object = PLAN, balanced_for: tuple[int, ...] = ()) -> GenerationRecord:
    return GenerationRecord(plan=plan, resume_step=50, incarnations={n: 0 for n in range(4)},  # type: ignore[arg-type]
                            balanced_for=list(balanced_for))


def _speeds(busy: dict[int, float] | None, marked: dict[int, Mark], generation: int = 3) -> StragglerRecord:
    return StragglerRecord(step=60, generation=generation, at=0.0, policy="x", threshold=1.25,
                           factors={n: (2.0 if n in marked else 1.0) for n in range(4)}, busy=busy or {},
                           marked=marked)


def _decide(policy: str, record: GenerationRecord, speeds: StragglerRecord | None, spare: int | None = None,
            ) -> Resplit | DrainStraggler | None:
    asked: list[int] = []

    def spare_for(node: int) -> int | None:
        asked.append(node)
        return spare

    out = straggler_decision(policy=policy, g=3, record=record, speeds=speeds, tset=TSET, gain=0.1, spare_for=spare_for)
    assert policy == "auto" or not asked, "only auto asks for a spare"
    return out


@pytest.mark.parametrize("policy", ["off", "report"])
def test_off_and_report_never_change_the_plan(policy: str) -> None:
    assert _decide(policy, _record(), _speeds(SLOW, MARK), spare=4) is None


@pytest.mark.parametrize("policy", ["off", "report"])
def test_a_policy_changed_away_from_acting_brings_the_planner_split_back(policy: str) -> None:
    got = _decide(policy, _record(SPLIT_FOR_3, balanced_for=(3,)), _speeds(SLOW, MARK))
    assert isinstance(got, Resplit) and got.plan == PLAN and got.balanced_for == []
    assert f"the straggler policy is now {policy}" in got.reason


@pytest.mark.parametrize("policy", ["rebalance", "auto"])
def test_a_marked_node_without_a_spare_is_rebalanced_away_from(policy: str) -> None:
    got = _decide(policy, _record(), _speeds(SLOW, MARK))
    expected = rebalanced(PLAN, {n: b / 8 for n, b in SLOW.items()}).plan
    assert isinstance(got, Resplit) and got.plan == expected and got.balanced_for == [3]
    assert [p.microbatches for p in got.plan.pipelines] == [p.microbatches for p in SPLIT_FOR_3.pipelines]
    assert got.reason.startswith("rebalance for straggler(s) node 3 at 2.00x: microbatches [8, 8] -> [11, 5]")


@pytest.mark.parametrize("policy", ["rebalance", "auto"])
def test_a_marked_node_that_recovered_gets_its_share_back_and_says_so(policy: str) -> None:
    busy = {0: 0.11, 1: 0.11, 2: 0.05, 3: 0.05}  # 0.01 s a microbatch everywhere: [11, 5], node 3 at full speed
    speeds = dataclasses.replace(_speeds(busy, MARK), factors=dict.fromkeys(range(4), 1.0))  # still marked
    got = _decide(policy, _record(SPLIT_FOR_3, balanced_for=(3,)), speeds)
    assert isinstance(got, Resplit) and [p.microbatches for p in got.plan.pipelines] == [8, 8]
    assert got.reason.startswith("rebalance for straggler(s) node 3 at 1.00x now (marked at 2.00x): "
                                 "microbatches [11, 5] -> [8, 8]"), got.reason


@pytest.mark.parametrize("policy", ["rebalance", "auto"])
def test_no_decision_before_a_full_window_of_this_generation(policy: str) -> None:
    assert _decide(policy, _record(), _speeds(SLOW, MARK, generation=2)) is None  # measured under the last plan
    assert _decide(policy, _record(), _speeds({0: 0.1, 1: 0.1, 3: 0.2}, MARK)) is None  # node 2 has no window yet


def test_rebalance_takes_no_spare_and_auto_does() -> None:
    assert isinstance(_decide("rebalance", _record(), _speeds(SLOW, MARK), spare=4), Resplit)
    got = _decide("auto", _record(), _speeds(SLOW, MARK), spare=4)
    assert isinstance(got, DrainStraggler) and (got.node, got.choice, got.factor) == (3, "spare", 2.0)
    assert got.estimates.startswith("nothing ") and "spare " in got.estimates


@pytest.mark.parametrize("policy", ["rebalance", "auto"])
def test_once_its_pipeline_is_as_fast_again_the_split_goes_back_before_the_mark_clears(policy: str) -> None:
    busy = {0: 0.1 * 11 / 8, 1: 0.1 * 11 / 8, 2: 0.1 * 5 / 8, 3: 0.1 * 5 / 8}  # node 3 recovered, at 11 / 5
    got = _decide(policy, _record(SPLIT_FOR_3, balanced_for=(3,)), _speeds(busy, MARK))
    assert isinstance(got, Resplit) and [p.microbatches for p in got.plan.pipelines] == [8, 8]


@pytest.mark.parametrize("policy", ["rebalance", "auto"])
def test_no_mark_left_brings_the_planner_split_back_and_then_nothing(policy: str) -> None:
    got = _decide(policy, _record(SPLIT_FOR_3, balanced_for=(3,)), _speeds(EVEN, {}))
    assert isinstance(got, Resplit) and got.plan == PLAN and "no straggler left" in got.reason
    assert _decide(policy, _record(), _speeds(EVEN, {})) is None
    assert _decide(policy, _record(), None) is None
