"""ReCycle's rerouting in the planner's cost model: the step time of homogeneous pipelines
whose failed stages' microbatches run on the same stage of the other pipelines.

Pipelines p = 0 .. D-1 of d stages each; slot (p, s) runs stage s of pipeline p at `t[p][s]`
seconds a microbatch (the template's stage time, times its node's slowdown), or is a hole (its
node failed). A hole's microbatches (its pipeline's m_p) are spread over the surviving slots
of its stage, each next microbatch to the least loaded (ties to the lower pipeline), so a
survivor of stage s runs m_q + e_q microbatches there. The failed pipeline's other stages
still run their m_p, and its microbatches still pass every stage once.

A pipeline's step time generalises the planner's 1F1B formula (`templates.cost.pipeline_time`,
sum of stage times + (m - 1) x the slowest) to stages running different numbers of
microbatches: its fill and drain (every stage once, a hole at its template time) plus the
most loaded stage's remaining work, sum_s t[p][s] + max_s (L[p][s] - 1) x t[p][s]. With no hole
it is exactly `pipeline_time`. Of a survivor's extra work e_q x t, a share `hidden` goes into
its stage's bubbles, never more than that stage's idle time in the hole-free step
(step - m_q x t); the rest lengthens the stage. The step is the slowest pipeline's time. The
detour's extra p2p transfers are not counted (a few activations per microbatch).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def reroute_extra(microbatches: Sequence[int], holes: Sequence[int]) -> dict[int, int] | None:
    """Extra microbatches per surviving pipeline for one stage whose pipelines `holes` lost
    their node there (module docstring); None if every pipeline did."""
    lost = set(holes)
    survivors = [p for p in range(len(microbatches)) if p not in lost]
    if not survivors:
        return None
    extra = dict.fromkeys(survivors, 0)
    heap = [(microbatches[p], p) for p in survivors]
    heapq.heapify(heap)
    for _ in range(sum(microbatches[p] for p in lost)):
        load, p = heapq.heappop(heap)
        extra[p] += 1
        heapq.heappush(heap, (load + 1, p))
    return extra


def rerouted_step_s(base: Sequence[Sequence[float]], times: Sequence[Sequence[float | None]],
                    microbatches: Sequence[int], *, hidden: float) -> float | None:
    """Seconds per step (module docstring): `base[p][s]` the template's stage time of slot (p, s),
    `times[p][s]` its node's (None for a hole), `microbatches[p]` pipeline p's share; None if a
    stage lost every node (the job cannot run it)."""
    depth = len(base[0])
    extras: dict[tuple[int, int], int] = {}
    for s in range(depth):
        holes = [p for p, row in enumerate(times) if row[s] is None]
        if holes:
            extra = reroute_extra(microbatches, holes)
            if extra is None:
                return None
            extras.update({(p, s): e for p, e in extra.items() if e})
    step = 0.0
    for p, row in enumerate(times):
        m = microbatches[p]
        fill = sum(base[p][s] if t is None else t for s, t in enumerate(row))
        own = [t for t in row if t is not None]
        plain = fill + (m - 1) * max(own, default=0.0)  # the hole-free 1F1B step of this pipeline
        worst = max(((m - 1) * t for t in own), default=0.0)
        for s, t in enumerate(row):
            e = extras.get((p, s), 0)
            if t is None or not e:
                continue
            work = e * t
            shown = work - min(hidden * work, max(0.0, plain - m * t))  # what the bubbles cannot hide
            worst = max(worst, (m - 1) * t + shown)
        step = max(step, fill + worst)
    return step
