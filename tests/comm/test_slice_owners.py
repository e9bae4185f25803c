"""The sharded optimizer's slice owners across a re-plan (issue 55): the leader keeps each surviving
owner on the slice that overlaps most what it owned (`plan_owners(..., previous=)`), and the
generation record carries the owners (`GenerationRecord.slice_owners`), so a recovery moves only
what the new slices lack.

Real Trainers on threads (tests/comm/cluster.py), 6 one-stage pipelines at f = 1 (3 slices of 2
owners), one node lost: 5 pipelines, 2 slices. Each run with the owners kept, and with plan 2's
own, against the same job unsharded:

- the bytes each run's repair received equal the pure model's (`templates.optim_slices.slice_moves`:
  12 bytes an element, the parameter and its two moments), and keeping the owners moves fewer;
- both end bit for bit as the unsharded run (parameters, moments, step count);
- every communicator's log passes the NCCL model's check.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic.comm.nccl_model import check
from elastic.records.generation import GenerationRecord
from templates.optim_slices import owner_rows, plan_owners, slice_moves
from templates.plan import PipelinePlan, Plan, StagePlan
from tests.comm.cluster import LAYERS, Case, Outcome, run_case, same_end_state

pytestmark = [pytest.mark.timeout(120)]

BYTES_PER_ELEMENT = 12
"""What the repair sends of an element: the parameter and its two float32 moments."""


def _plan(nodes: list[int]) -> Plan:
    """One one-stage pipeline a node, 6 microbatches over them, f = 1."""
    counts = [6 // len(nodes) + (i < 6 % len(nodes)) for i in range(len(nodes))]
    return Plan(num_layers=LAYERS, microbatch_size=1, fault_tolerance=1, pipelines=tuple(
        PipelinePlan(stages=(StagePlan(node=n, layers=(0, LAYERS)),), microbatches=m)
        for n, m in zip(nodes, counts, strict=True)))


def _run(tmp_path: Path, name: str, lost: int, *, sharded: bool, keep: bool) -> Outcome:
    nodes = list(range(6))
    case = Case(name=name, plan1=_plan(nodes), plan2=_plan([n for n in nodes if n != lost]),
                failed=frozenset({lost}), shard_optimizer=sharded, keep_owners=keep)
    out = run_case(case, tmp_path / name)
    assert not out.errors, out.errors
    check(out.logs)
    return out


def _model_bytes(unsharded: Outcome, lost: int, *, keep: bool) -> int:
    """What `slice_moves` says the survivors lack, in bytes, for the layers' real sizes."""
    plan1, plan2 = _plan(list(range(6))), _plan([n for n in range(6) if n != lost])
    before = plan_owners(plan1)
    after = plan_owners(plan2, previous=before) if keep else plan_owners(plan2)
    shards = next(iter(unsharded.shards.values()))
    total = 0
    for key, shard in shards.items():
        sizes = [shard[name].numel() for name in sorted(n for n in shard if n.startswith("param/"))]
        moves = slice_moves(before[key.layer], after[key.layer], sizes=sizes, live=plan2.nodes)
        total += sum(m.stop - m.start for m in moves)
    return BYTES_PER_ELEMENT * total


@pytest.mark.parametrize("lost", [5, 0, 2])
def test_kept_owners_move_fewer_bytes_and_end_bit_for_bit(tmp_path: Path, lost: int) -> None:
    unsharded = _run(tmp_path, "off", lost, sharded=False, keep=False)
    kept = _run(tmp_path, "kept", lost, sharded=True, keep=True)
    fresh = _run(tmp_path, "fresh", lost, sharded=True, keep=False)
    assert sum(unsharded.received.values()) == 0  # one-stage pipelines: every survivor holds every layer
    got = {"kept": sum(kept.received.values()), "fresh": sum(fresh.received.values())}
    want = {"kept": _model_bytes(unsharded, lost, keep=True), "fresh": _model_bytes(unsharded, lost, keep=False)}
    assert got == want
    assert got["kept"] < got["fresh"], got
    for out in (kept, fresh):
        same_end_state(unsharded, out)


def test_the_record_carries_the_owners_and_refuses_others() -> None:
    plan1, plan2 = _plan(list(range(6))), _plan([0, 1, 2, 3, 4])
    owners = plan_owners(plan2, previous=plan_owners(plan1))
    record = GenerationRecord(plan=plan2, resume_step=1, incarnations=dict.fromkeys(plan2.nodes, 0),
                              slice_owners=owner_rows(owners))
    assert GenerationRecord.from_json(record.to_packed()).owners() == owners
    assert GenerationRecord(plan=plan2, resume_step=1, incarnations={}).owners() == plan_owners(plan2)
    bad = record.to_dict()
    bad["slice_owners"][3] = [[0, 1], [2, 3]]  # node 4 owns nothing of layer 3
    with pytest.raises(ValueError, match=r"slice_owners: layer 3: slice owners \[\[0, 1\], \[2, 3\]\]"):
        GenerationRecord.from_dict(bad)
    bad["slice_owners"][3] = [[0, 1, 2, 3, 4]]  # one slice where 5 holders at f = 1 make 2
    with pytest.raises(ValueError, match="are not 2 slices"):
        GenerationRecord.from_dict(bad)
    bad["slice_owners"][3] = [[0], [1, 2, 3, 4]]  # a slice of one owner at f = 1
    with pytest.raises(ValueError, match="at least 2"):
        GenerationRecord.from_dict(bad)
    bad["slice_owners"] = bad["slice_owners"][:2]
    with pytest.raises(ValueError, match="name 2 layers, the plan has"):
        GenerationRecord.from_dict(bad)
