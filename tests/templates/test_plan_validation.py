"""Plan validation (templates/plan.py): the quick pass accepts exactly the plans the
stage-by-stage checks accept, and a plan it rejects gets the message those checks give first."""

from __future__ import annotations

import dataclasses
import random

import pytest

from templates.plan import PipelinePlan, Plan, PlanError, StagePlan, even_plan
from templates.profile import RECOMPUTE_MODES


def first_error(num_layers: int, pipelines: tuple[PipelinePlan, ...], fault_tolerance: int) -> str | None:
    """Every check, stage by stage, in the order the plan format lists them (None: valid)."""
    if len(pipelines) < fault_tolerance + 1:
        return f"plan has {len(pipelines)} pipelines; fault tolerance {fault_tolerance} needs at least {fault_tolerance + 1}"
    seen: set[int] = set()
    for p, pipe in enumerate(pipelines):
        if pipe.microbatches < 1:
            return f"pipeline {p} has {pipe.microbatches} microbatches; each needs at least 1"
        if not pipe.stages:
            return f"pipeline {p} has no stages"
        v = len(pipe.stages[0].ranges)
        for s, stage in enumerate(pipe.stages):
            if stage.chunks and stage.chunks[0] != stage.layers:
                return f"pipeline {p} stage {s}: chunk 0 {list(stage.chunks[0])} is not its layers {list(stage.layers)}"
            if len(stage.ranges) != v:
                return (f"pipeline {p} stage {s} has {len(stage.ranges)} chunks, stage 0 has {v}: every stage of a "
                        "pipeline holds the same number")
        if v > 1 and len(pipe.stages) < 2:
            return f"pipeline {p} has one stage and {v} chunks: interleaving needs at least 2 stages"
        covered = 0
        for k, (first, last) in enumerate(st.ranges[c] for c in range(v) for st in pipe.stages):
            if first != covered or last <= first:
                where = f"stage {k}" if v == 1 else f"virtual stage {k} (stage {k % len(pipe.stages)} chunk {k // len(pipe.stages)})"
                return (f"pipeline {p} {where} holds layers [{first}, {last}); stages must cover [0, {num_layers}) "
                        "contiguously, in order, each non-empty")
            covered = last
        for s, stage in enumerate(pipe.stages):
            if stage.recompute not in RECOMPUTE_MODES:
                return f"pipeline {p} stage {s} recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {stage.recompute!r}"
            if stage.node in seen:
                return f"node {stage.node} appears more than once in the plan"
            if stage.node < 0:
                return f"node ids must be >= 0, got {stage.node}"
            seen.add(stage.node)
        if covered != num_layers:
            return f"pipeline {p} covers layers [0, {covered}) but the model has {num_layers}"
    return None


def _mutated(rng: random.Random, stage: StagePlan) -> StagePlan:
    roll = rng.random()
    if roll < 0.25:
        return dataclasses.replace(stage, node=rng.choice([-1, 0, 1, 5]))
    if roll < 0.45:
        return dataclasses.replace(stage, recompute=rng.choice(["full", "bogus"]))
    if roll < 0.75:
        first, last = stage.layers
        return dataclasses.replace(stage, layers=(first + rng.choice([-1, 0, 1]), last + rng.choice([-1, 0, 1])))
    return dataclasses.replace(stage, chunks=rng.choice([(), (stage.layers,), (stage.layers, (0, 1))]))


@pytest.mark.parametrize("seed", range(4))
def test_the_quick_pass_agrees_with_the_stage_by_stage_checks(seed: int) -> None:
    rng = random.Random(seed)
    outcomes = set()
    for _ in range(1500):
        base = even_plan(num_layers=12, nodes=list(range(rng.randint(2, 6))), num_pipelines=rng.randint(1, 2),
                         global_microbatches=4, microbatch_size=1, virtual_stages=rng.choice([1, 1, 2]))
        pipes = []
        for pipe in base.pipelines:
            stages = tuple(_mutated(rng, s) if rng.random() < 0.3 else s for s in pipe.stages)
            stages = stages[:-1] if rng.random() < 0.1 else stages
            pipes.append(PipelinePlan(stages=stages, microbatches=rng.choice([0, 1, 2, 2])))
        f = rng.choice([0, 0, 1])
        expected = first_error(12, tuple(pipes), f)
        try:
            Plan(num_layers=12, microbatch_size=1, pipelines=tuple(pipes), fault_tolerance=f)
            got = None
        except PlanError as exc:
            got = str(exc)
        assert got == expected
        outcomes.add(None if got is None else got.split(" ")[0:3][-1])
    assert None in outcomes and len(outcomes) >= 5, outcomes  # valid plans and several kinds of error
