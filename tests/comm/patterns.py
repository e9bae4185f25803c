"""Which communication patterns a generated job exercised (tests/comm/cluster.py), read from its
plans and its workers' logs: the coverage that issue 31's list of cases asks for."""

from __future__ import annotations

from elastic.comm import Event
from templates.optim_slices import plan_owners
from tests.comm.cluster import Case

FRAME = 64 << 10
"""A shard exchange's first header frame (elastic/transfer/collective.py HEADER_FRAME_BYTES)."""
SUMS_TAG = 8
"""The tag of the kept sums' exchange (elastic/engine/replay_sums.py)."""

WANTED = frozenset({
    "group of 2", "group of 3", "group of 4",  # data parallelism: 2-4 holders per bucket
    *(f"stages={d}" for d in (1, 2, 3, 4)),
    *(f"microbatches={m}" for m in range(1, 9)),  # of a pipeline of 2+ stages
    "heterogeneous plan", "tp=2", "vote", "evaluation", "full-state gather", "partial replay",
    "kept sums moved", "two-way shard moves", "shard rotation", "spare takes a stage",
    "recompute selective", "recompute full with tp=2",  # full reposts TP all-reduces in the backward
    "sequence parallel with tp=2", "reduce-scatter", "recompute full with sequence parallel",
    "interleaved v=2", "interleaved v=3", "interleaved beside another depth", "re-plan changes v",
    "interleaved with tp=2", "scatter/gather with tp=2", "interleaved partial failure",
    "sharded optimizer", "sharded optimizer through a failure", "sharded optimizer partial failure",
    "sharded optimizer with tp=2", "llama", "llama with tp=2", "llama sharing key/value heads with tp=2",
    "tied embeddings in one stage", "tied embeddings across stages", "tied embeddings across stages with tp=2",
})


def features(case: Case, logs: dict[tuple[int, int], list[Event]]) -> set[str]:
    """The patterns of WANTED (and others) that one job exercised."""
    out: set[str] = set()
    pipelines = (*case.plan1.pipelines, *case.plan2.pipelines)
    out |= {f"stages={len(p.stages)}" for p in pipelines}
    out |= {f"microbatches={p.microbatches}" for p in pipelines if len(p.stages) > 1}
    if len({len(p.stages) for p in case.plan1.pipelines}) > 1:
        out.add("heterogeneous plan")
    if case.plan1.gpus_per_node > 1:
        out.add("tp=2")
    if case.shape.arch == "llama":  # grouped-query attention, SwiGLU: the same collectives, other sizes
        out.add("llama" + (" with tp=2" if case.plan1.gpus_per_node > 1 else ""))
        if case.shape.kv_heads < case.plan1.gpus_per_node:  # the shared head's gradient: one more all-reduce
            out.add("llama sharing key/value heads with tp=2")
    if case.shape.tie_embeddings:  # the tied sum: local in a one-stage pipeline, point to point across stages
        deep = any(len(p.stages) > 1 for p in pipelines)
        out.add("tied embeddings " + ("across stages" if deep else "in one stage")
                + (" with tp=2" if deep and case.plan1.gpus_per_node > 1 else ""))
    if case.evaluate:
        out.add("evaluation")
    if case.partial:
        out.add("partial replay")
    if case.recompute != "none":
        out.add(f"recompute {case.recompute}" + (" with tp=2" if case.plan1.gpus_per_node > 1 else ""))
    if case.sequence_parallel and case.plan1.gpus_per_node > 1:
        out.add("sequence parallel with tp=2")
        if case.recompute == "full":
            out.add("recompute full with sequence parallel")  # the backward gathers and scatters again
    out |= _schedules(case) | _sharding(case)
    if set(case.plan2.nodes) - set(case.plan1.nodes):
        out.add("spare takes a stage")
    sends: set[tuple[int, int]] = set()
    for worker, log in logs.items():
        for e in log:
            if e.kind == "create" and e.comm is not None and not e.comm.endswith("/world"):
                out.add(f"group of {len(e.members)}")
            for op in e.ops:
                if op.kind == "all_gather" and not (case.sequence_parallel and case.plan1.gpus_per_node > 1):
                    out.add("full-state gather")
                if op.kind == "reduce_scatter":
                    out.add("reduce-scatter")
                if op.kind == "all_reduce" and op.nbytes == 32:
                    out.add("vote")
                if e.comm == "g2/world" and op.kind == "send" and op.nbytes == FRAME:
                    sends.add((worker[0], _node_of(logs, op.peer, e.comm)))
                    if op.tag == SUMS_TAG:
                        out.add("kept sums moved")
    if any((b, a) in sends for a, b in sends):
        out.add("two-way shard moves")
    if any((b, c) in sends and (c, a) in sends and len({a, b, c}) == 3 for a, b in sends for _, c in sends):
        out.add("shard rotation")
    return out


def _schedules(case: Case) -> set[str]:
    """The interleaved schedule's patterns and scatter/gather's."""
    out = set()
    tp = case.plan1.gpus_per_node
    for plan in (case.plan1, case.plan2):
        vs = [p.virtual_stages for p in plan.pipelines]
        out |= {f"interleaved v={v}" for v in vs if v > 1}
        if any(v > 1 for v in vs) and len({len(p.stages) for p in plan.pipelines}) > 1:
            out.add("interleaved beside another depth")
        if any(v > 1 for v in vs) and tp > 1:
            out.add("interleaved with tp=2")
    if case.partial and any(p.virtual_stages > 1 for p in case.plan1.pipelines):
        out.add("interleaved partial failure")
    if ({p.virtual_stages for p in case.plan1.pipelines} != {p.virtual_stages for p in case.plan2.pipelines}):
        out.add("re-plan changes v")
    if tp > 1 and case.scatter_gather and not case.sequence_parallel:
        out.add("scatter/gather with tp=2")
    return out


def _sharding(case: Case) -> set[str]:
    """The sharded optimizer's patterns: where some layer has 2 slices or more (a gather)."""
    if not case.shard_optimizer or all(o.slices < 2 for p in (case.plan1, case.plan2) for o in plan_owners(p).values()):
        return set()
    out = {"sharded optimizer"}
    if case.failed:
        out.add("sharded optimizer through a failure")
        if case.partial:
            out.add("sharded optimizer partial failure")
    if case.plan1.gpus_per_node > 1:
        out.add("sharded optimizer with tp=2")
    return out


def _node_of(logs: dict[tuple[int, int], list[Event]], rank: int | None, comm: str) -> int:
    for worker, log in logs.items():
        if any(e.kind == "create" and e.comm == comm and e.rank == rank for e in log):
            return worker[0]
    raise AssertionError(f"no worker is rank {rank} of {comm}")
