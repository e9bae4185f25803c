"""The sharded optimizer's checkpoint (issue 55): each slice of a layer's state is written once, by
one of its owners, with no gather, and the step reads back as the unsharded run's, bit for bit.

Real Trainers on threads (tests/comm/cluster.py), each worker writing its parts of the end state
(`Trainer.checkpoint_parts`) with its own real `CheckpointWriter` into one directory, against
the same job unsharded written whole:

- 6 one-stage pipelines at f = 1 that lose node 0 and keep the survivors on their slices (the
  owners come from the leader's record, not the plan's own), and two pipelines of two stages cut
  at different layers at TP 2 (each tensor-parallel rank its own slices, a tied head);
- every slice is written exactly once, by a worker of a node that owns it; a layer's S slices by
  S different nodes; the parts hold the bytes of the whole shards, once;
- the sliced step is complete and loads as the whole one, bit for bit, and as the unsharded run
  ended (parameters, moments, step count); so does it through the resharding loader at another
  tensor-parallel degree, `--resume`'s choice of a step and `elastic export`'s parameters;
- a slice never committed leaves the step incomplete, naming the slice; a slice's corrupt file
  is found by its CRC-32, naming the slice; a slice marker whose offsets overlap another's is
  refused by the assembly.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from elastic.engine.checkpoint.files import CheckpointError, read_marker, step_dir
from elastic.engine.checkpoint.load import latest_complete, load_shards
from elastic.engine.checkpoint.params import checkpoint_params
from elastic.engine.checkpoint.reshard import load_resharded
from elastic.engine.checkpoint.resume import find_resume_point, verify_crcs
from elastic.engine.checkpoint.writers import CheckpointWriter
from elastic.transfer.shards import ShardKey
from templates.optim_slices import plan_owners
from templates.plan import PipelinePlan, Plan, StagePlan
from tests.comm.cluster import LAYERS, SHARED_KV_SHAPE, Case, Outcome, run_case
from tests.comm.test_slice_owners import _plan

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def _six_lose_one() -> Case:
    return Case(name="six", plan1=_plan(list(range(6))), plan2=_plan(list(range(1, 6))), failed=frozenset({0}))


def _tp2_two_stages() -> Case:
    cuts = [((0, 3), (3, LAYERS)), ((0, 2), (2, LAYERS))]
    plan = Plan(num_layers=LAYERS, microbatch_size=1, gpus_per_node=2, fault_tolerance=0, pipelines=tuple(
        PipelinePlan(stages=tuple(StagePlan(node=2 * p + s, layers=r) for s, r in enumerate(stages)), microbatches=2)
        for p, stages in enumerate(cuts)))
    return Case(name="tp2", plan1=plan, plan2=plan, shape=dataclasses.replace(SHARED_KV_SHAPE, tie_embeddings=True),
                sequence_parallel=False)


def _run(case: Case, root: Path, *, sharded: bool) -> Outcome:
    case = dataclasses.replace(case, name=f"{case.name}-{'on' if sharded else 'off'}", shard_optimizer=sharded)
    out = run_case(case, root / case.name)
    assert not out.errors, out.errors
    return out


def _write(out: Outcome, directory: Path, tp: int, *, sharded: bool) -> int:
    """Every worker's parts of the end state (sharded) or one copy of each shard (unsharded),
    each worker through its own writer; the step written."""
    directory.mkdir()
    (step,) = set(out.steps.values())
    if sharded:
        for mine in out.parts.values():
            writer = CheckpointWriter(directory, num_layers=LAYERS, tp_degree=tp)
            writer.save_parts(step, mine)
            writer.close()
    else:
        whole = {key: state for mine in out.shards.values() for key, state in mine.items()}
        writer = CheckpointWriter(directory, num_layers=LAYERS, tp_degree=tp)
        writer.save_async(step, whole)
        writer.close()
    return step


@pytest.mark.parametrize("make", [_six_lose_one, _tp2_two_stages], ids=["six-lose-one", "tp2-two-stages"])
def test_each_slice_is_written_once_by_an_owner_and_reads_back_whole(tmp_path: Path, make: object) -> None:
    case = make()  # type: ignore[operator]
    tp = case.plan1.gpus_per_node
    on, off = _run(case, tmp_path, sharded=True), _run(case, tmp_path, sharded=False)
    owners = plan_owners(case.plan2, previous=plan_owners(case.plan1))  # as the leader keeps them
    written: dict[tuple[ShardKey, int], tuple[int, int]] = {}
    heads = 0
    for worker, mine in on.parts.items():
        for part in mine:
            assert part.sliced is not None, f"worker {worker} wrote {part.key} whole"
            if part.sliced.index is None:
                heads += 1
                assert part.sliced.slices == owners[part.key.layer].slices
                continue
            slot = (part.key, part.sliced.index)
            assert slot not in written, f"slice {slot} written by {written[slot]} and {worker}"
            assert worker[0] in owners[part.key.layer].owners[part.sliced.index], (worker, slot)
            assert worker[1] == part.key.tp_rank
            written[slot] = worker
    keys = sorted({k for mine in off.shards.values() for k in mine})
    assert heads == len(keys)
    assert sorted(written) == sorted((k, j) for k in keys for j in range(owners[k.layer].slices))
    for key in keys:  # a layer's slices by as many nodes
        nodes = {written[(key, j)][0] for j in range(owners[key.layer].slices)}
        assert len(nodes) == owners[key.layer].slices, (key, nodes)
    whole = {k: s for mine in off.shards.values() for k, s in mine.items()}
    bytes_whole = sum(t.nbytes for s in whole.values() for n, t in s.items() if n != "step")
    bytes_parts = sum(t.nbytes for mine in on.parts.values() for p in mine for n, t in p.tensors.items() if n != "step")
    assert bytes_parts == bytes_whole

    sliced_dir, whole_dir = tmp_path / "sliced", tmp_path / "whole"
    step = _write(on, sliced_dir, tp, sharded=True)
    assert _write(off, whole_dir, tp, sharded=False) == step
    assert latest_complete(sliced_dir, num_layers=LAYERS, tp_degree=tp) == step
    assert read_marker(sliced_dir, step, keys[0]).version == 3  # type: ignore[union-attr]
    assert read_marker(whole_dir, step, keys[0]).version == 2  # type: ignore[union-attr]  # older readers read it
    got, want = load_shards(sliced_dir, step, keys), load_shards(whole_dir, step, keys)
    for key in keys:
        assert got[key].keys() == want[key].keys() == whole[key].keys()
        for name, tensor in want[key].items():
            assert got[key][name].equal(tensor) and whole[key][name].equal(tensor), (key, name)
    verify_crcs(sliced_dir, step)
    # what reads a step through the resharding loader: `--resume` at another degree, `elastic export`
    source = find_resume_point(tmp_path, case.shape, checkpoint_dir=sliced_dir)
    assert (source.step, source.tp_degree) == (step, tp)
    degree = 1 if tp > 1 else 2
    other = [ShardKey(layer, t) for layer in range(LAYERS) for t in range(degree)]
    resharded = load_resharded(sliced_dir, step, other, cfg=case.shape, tp_degree=degree)
    for key, state in load_resharded(whole_dir, step, other, cfg=case.shape, tp_degree=degree).items():
        assert all(resharded[key][name].equal(t) for name, t in state.items()), key
    params = checkpoint_params(sliced_dir, step, case.shape, tp_degree=tp)
    assert all(params[n].equal(t) for n, t in checkpoint_params(whole_dir, step, case.shape, tp_degree=tp).items())


def test_a_missing_corrupt_or_overlapping_slice_is_named(tmp_path: Path) -> None:
    case = _six_lose_one()
    on = _run(case, tmp_path, sharded=True)
    directory = tmp_path / "sliced"
    step = _write(on, directory, 1, sharded=True)
    key = ShardKey(2, 0)
    base = step_dir(directory, step)
    head = read_marker(directory, step, key)
    assert head is not None and head.slices == 2

    marker1 = base / "layer-0002-tp-00-slice-001-of-002.done"
    saved = marker1.read_text()
    marker1.unlink()
    assert latest_complete(directory, num_layers=LAYERS, tp_degree=1) is None
    with pytest.raises(CheckpointError, match=r"\(layer 2, tp 0; its slice 1 of 2\)"):
        load_shards(directory, step, [key])
    marker1.write_text(saved)
    assert latest_complete(directory, num_layers=LAYERS, tp_degree=1) == step

    piece = read_marker(directory, step, key, index=1, slices=2)
    assert piece is not None and piece.offsets
    data = next(p for p in sorted((base / piece.data).iterdir()) if p.suffix == ".distcp")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="slice layer-0002-tp-00-slice-001-of-002 .* is corrupt"):
        verify_crcs(directory, step)
    with pytest.raises(CheckpointError, match="slice-001-of-002 .* is corrupt"):
        load_shards(directory, step, [key])
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))

    fields = json.loads(saved)
    first = min(fields["offsets"], key=lambda n: fields["offsets"][n])
    fields["offsets"][first] -= 1
    marker1.write_text(json.dumps(fields))
    with pytest.raises(CheckpointError, match="overlap, leave a gap or overrun"):
        load_shards(directory, step, [key])

