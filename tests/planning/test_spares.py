"""The hot-spare choice (elastic/planning/spares.py) as a unit: which spares a re-plan takes in,
which newcomers join at a step boundary, and what happens when no spare is left."""

from __future__ import annotations

import pytest

from elastic.planning.spares import newcomers_to_join, spare_nodes, spares_to_take, substitute
from templates.plan import Plan, even_plan

pytestmark = pytest.mark.timeout(10)


def test_one_loss_takes_the_lowest_numbered_ready_spare() -> None:
    assert spares_to_take(survivors=[0, 2, 3], ready=[6, 4, 5], active=4) == [4]


def test_as_many_spares_as_nodes_lost() -> None:
    assert spares_to_take(survivors=[0, 3], ready=[5, 4, 6], active=4) == [4, 5]


def test_fewer_spares_than_losses_takes_every_spare() -> None:
    assert spares_to_take(survivors=[0], ready=[4], active=4) == [4]


def test_no_spare_left_takes_none() -> None:
    # The re-plan then runs on the survivors alone, as without spares.
    assert spares_to_take(survivors=[0, 2, 3], ready=[], active=4) == []


def test_no_spare_taken_when_the_survivors_reach_the_node_count() -> None:
    assert spares_to_take(survivors=[0, 1, 2, 3], ready=[4], active=4) == []


def test_a_survivor_is_never_taken_as_its_own_spare() -> None:
    assert spares_to_take(survivors=[0, 1, 2], ready=[1, 2, 7], active=4) == [7]


def test_a_returning_node_joins_a_short_plan_and_is_a_spare_otherwise() -> None:
    # No spare configured: a restarted node rejoins the degraded plan, as the runtime always did.
    assert newcomers_to_join(current=[0, 2, 3], ready=[1], active=4) == [1]
    # The plan is at full strength (a spare took the lost node's place): the returning node waits.
    assert newcomers_to_join(current=[0, 2, 3, 4], ready=[1], active=4) == []
    # Two return to a plan one short: the lower id joins, the other is a spare.
    assert newcomers_to_join(current=[0, 3, 4], ready=[2, 1], active=4) == [1]


def test_spare_nodes_are_the_live_nodes_outside_the_generation() -> None:
    assert spare_nodes(live=[0, 1, 2, 3, 4], in_generation={0, 2, 3, 4}) == [1]
    assert spare_nodes(live=[0, 1], in_generation={0, 1}) == []


def test_a_bad_node_count_is_refused() -> None:
    with pytest.raises(ValueError, match="active node count"):
        spares_to_take(survivors=[], ready=[1], active=0)


def _plan() -> Plan:
    return even_plan(num_layers=6, nodes=[0, 1, 2, 3], num_pipelines=2, global_microbatches=4, microbatch_size=2,
                     fault_tolerance=1)


def test_substitute_puts_each_spare_in_its_lost_nodes_stage() -> None:
    plan = _plan()
    new = substitute(plan, {1: 4})
    assert [[(st.node, st.layers) for st in p.stages] for p in new.pipelines] == [
        [(4 if st.node == 1 else st.node, st.layers) for st in p.stages] for p in plan.pipelines]
    assert sorted(new.nodes) == [0, 2, 3, 4]
    assert [p.microbatches for p in new.pipelines] == [p.microbatches for p in plan.pipelines]
    assert new.fault_tolerance == plan.fault_tolerance and new.iteration_time == plan.iteration_time
    assert Plan.from_json(new.to_json()) == new


def test_substitute_refuses_a_node_outside_the_plan_or_a_spare_inside_it() -> None:
    with pytest.raises(ValueError, match="not in the plan"):
        substitute(_plan(), {7: 4})
    with pytest.raises(ValueError, match="distinct and new"):
        substitute(_plan(), {1: 2})
    with pytest.raises(ValueError, match="distinct and new"):
        substitute(_plan(), {1: 4, 2: 4})


@pytest.mark.slow  # imports torch (the run command's launcher)
@pytest.mark.parametrize(("argv", "message"), [
    (["run", "--spares", "-1", "--steps", "1"], "--spares must be >= 0, got -1"),
    (["run", "--static", "--spares", "1", "--steps", "1"], "cannot take --spares"),
    (["simulate", "--model", "tiny", "--nodes", "4", "--hours", "1", "--trace", "every=10m,min=2", "--spares", "-2"],
     "--spares must be >= 0, got -2"),
])
def test_bad_spares_flags_get_one_line_and_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from elastic.cli.main import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
