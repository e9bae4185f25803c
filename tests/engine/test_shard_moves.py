"""The collective shard path's moves, planned once by the leader (elastic/parallel/shard_moves.py):
checked against the plans themselves. After a loss, every rank of the new plan ends up with
exactly the shards of its stage (held or received), every sender holds what it sends, and a
shard no rank of the plan holds is left out; the rows survive the generation record's stored
form, and rows naming ranks outside the plan are refused."""

from __future__ import annotations

import dataclasses

import pytest

from elastic.parallel.layout import assign_ranks
from elastic.parallel.shard_moves import move_rows, moves_of, plan_moves, ranked_holdings
from elastic.planning.cluster import ClusterSpec, cluster_templates
from elastic.records.generation import GenerationRecord
from elastic.transfer.moves import ShardMove
from elastic.transfer.shards import ShardKey
from templates.instantiation import instantiate
from templates.plan import Plan

pytestmark = pytest.mark.timeout(60)

SPEC = ClusterSpec(model="tiny", nodes=6, gpus_per_node=2, fault_tolerance=1, global_batch=32, microbatch=2,
                   device_memory_gib=0.02)  # a pipeline of 2 or 3 nodes
TSET = cluster_templates(dataclasses.replace(SPEC, fault_tolerance=0))


def _plan(nodes: list[int]) -> Plan:
    return instantiate(TSET, nodes, global_microbatches=16, fault_tolerance=1)


def _stage_shards(plan: Plan) -> dict[tuple[int, int], set[ShardKey]]:
    """(node, local rank) -> the shards its stage needs under `plan`."""
    out = {}
    for w in assign_ranks(plan):
        first, last = plan.pipelines[w.pipeline].stages[w.stage].layers
        out[(w.node, w.local_rank)] = {ShardKey(layer, w.local_rank) for layer in range(first, last)}
    return out


def _after(plan: Plan, by_rank: dict[int, list[ShardKey]], moves: list[ShardMove]) -> dict[int, set[ShardKey]]:
    """Rank -> what it holds after the moves; asserts every sender holds what it sends."""
    out = {w.rank: set(by_rank.get(w.rank, [])) for w in assign_ranks(plan)}
    for m in moves:
        assert m.src != m.dst and m.key in by_rank.get(m.src, []), m
        out[m.dst].add(m.key)
    return out


def test_after_a_loss_every_rank_of_the_new_plan_gets_its_stage_from_the_survivors() -> None:
    old, survivors = _plan([0, 1, 2, 3, 4, 5]), [0, 2, 3, 4, 5]
    held = {w: shards for w, shards in _stage_shards(old).items() if w[0] in survivors}
    new = _plan(survivors)
    by_rank = ranked_holdings(new, held)
    moves = plan_moves(new, by_rank)
    assert moves, "the lost node's layers must move"
    need = {w.rank: _stage_shards(new)[(w.node, w.local_rank)] for w in assign_ranks(new)}
    after = _after(new, by_rank, moves)
    assert all(need[r] <= after[r] for r in need), "a rank misses a shard of its stage"
    received = {(m.key, m.dst) for m in moves}
    assert len(received) == len(moves), "a shard sent twice to one rank"
    assert received == {(k, r) for r in need for k in need[r] - set(by_rank.get(r, []))}, "only what is missing moves"


def test_a_shard_no_rank_of_the_plan_holds_is_left_out() -> None:
    old, survivors = _plan([0, 1, 2, 3, 4, 5]), [0, 2, 3, 4, 5]
    gone = ShardKey(2, 1)
    held = {w: shards - {gone} for w, shards in _stage_shards(old).items() if w[0] in survivors}
    new = _plan(survivors)
    by_rank = ranked_holdings(new, held)
    moves = plan_moves(new, by_rank)
    after = _after(new, by_rank, moves)
    need = {w.rank: _stage_shards(new)[(w.node, w.local_rank)] for w in assign_ranks(new)}
    lacking = {r: need[r] - after[r] for r in need if need[r] - after[r]}
    assert lacking and all(missed == {gone} for missed in lacking.values()), lacking


def test_the_rows_survive_the_generation_records_stored_form_and_foreign_ranks_are_refused() -> None:
    old, new = _plan([0, 1, 2, 3, 4, 5]), _plan([0, 2, 3, 4, 5])
    moves = plan_moves(new, ranked_holdings(new, {w: s for w, s in _stage_shards(old).items() if w[0] != 1}))
    record = GenerationRecord(plan=new, resume_step=3, incarnations=dict.fromkeys(new.nodes, 0),
                              moves=move_rows(moves))
    back = GenerationRecord.from_json(record.to_packed())
    assert back.moves is not None and moves_of(back.moves, back.plan) == moves
    world = len(assign_ranks(new))
    with pytest.raises(ValueError, match=f"outside the plan's {world}"):
        moves_of([(0, 0, 0, world)], new)
