"""Hand-built plans shared by the engine tests (the tiny preset has 6 planning layers)."""

from __future__ import annotations

from templates.plan import PipelinePlan, Plan, StagePlan, even_plan

TINY_LAYERS = 6


def single(*, microbatches: int = 8, mbs: int = 2) -> Plan:
    """(a) one process runs the whole model."""
    return even_plan(
        num_layers=TINY_LAYERS,
        nodes=[0],
        num_pipelines=1,
        global_microbatches=microbatches,
        microbatch_size=mbs,
    )


def two_by_two(*, microbatches: int = 8, mbs: int = 2) -> Plan:
    """(b) 2 pipelines x 2 stages."""
    return even_plan(
        num_layers=TINY_LAYERS,
        nodes=[0, 1, 2, 3],
        num_pipelines=2,
        global_microbatches=microbatches,
        microbatch_size=mbs,
    )


def hetero(*, tp: int = 1, mbs: int = 2) -> Plan:
    """(c)/(d): a 3-stage pipeline with 5 microbatches beside a 2-stage one with 3, different
    layer splits; node ids deliberately not in pipeline order."""
    return Plan(
        num_layers=TINY_LAYERS,
        microbatch_size=mbs,
        gpus_per_node=tp,
        fault_tolerance=1,
        pipelines=(
            PipelinePlan(
                stages=(
                    StagePlan(node=4, layers=(0, 2)),
                    StagePlan(node=0, layers=(2, 4)),
                    StagePlan(node=2, layers=(4, 6)),
                ),
                microbatches=5,
            ),
            PipelinePlan(
                stages=(StagePlan(node=1, layers=(0, 3)), StagePlan(node=3, layers=(3, 6))),
                microbatches=3,
            ),
        ),
    )
