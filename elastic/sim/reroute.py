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
from collections.abc import Mapping, Sequence


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
    holes = {(p, s) for p, row in enumerate(times) for s, t in enumerate(row) if t is None}
    extras = _extras(microbatches, holes, len(base[0]))
    if extras is None:
        return None
    per_row: dict[int, dict[int, int]] = {}
    for (p, s), e in extras.items():
        per_row.setdefault(p, {})[s] = e
    step = 0.0
    for p, row in enumerate(times):
        step = max(step, _row_step(base[p], row, microbatches[p], per_row.get(p, {}), hidden))
    return step


class Rerouting:
    """`rerouted_step_s` of one homogeneous plan as a few of its slots change (holes, slow
    nodes): a pipeline with no changed slot and no rerouted work takes its full-speed step,
    computed once, so a step costs the changed pipelines only (thousands of nodes, thousands
    of events)."""

    def __init__(self, base: Sequence[Sequence[float]], microbatches: Sequence[int]) -> None:
        self.base, self.microbatches = base, microbatches
        self.plain = [_row_step(row, row, m, {}, 0.0) for row, m in zip(base, microbatches, strict=True)]
        self.slowest_first = sorted(range(len(base)), key=lambda p: -self.plain[p])

    def step_s(self, changed: Mapping[tuple[int, int], float | None], *, hidden: float) -> float | None:
        """`rerouted_step_s` with slot (p, s) at `changed[(p, s)]` seconds (None: a hole) and
        every other slot at its base time."""
        extras = _extras(self.microbatches, {place for place, t in changed.items() if t is None}, len(self.base[0]))
        if extras is None:
            return None
        rows: dict[int, dict[int, int]] = {p: {} for p, _ in changed}
        for (p, s), e in extras.items():
            rows.setdefault(p, {})[s] = e
        step = 0.0
        for p, extra in rows.items():
            row = [changed.get((p, s), t) for s, t in enumerate(self.base[p])]
            step = max(step, _row_step(self.base[p], row, self.microbatches[p], extra, hidden))
        for p in self.slowest_first:  # the slowest pipeline that nothing changed
            if p not in rows:
                return max(step, self.plain[p])
        return step


def _extras(microbatches: Sequence[int], holes: set[tuple[int, int]], depth: int) -> dict[tuple[int, int], int] | None:
    """Extra microbatches per surviving slot (p, s) (only those with some), None if a stage lost
    every node."""
    extras: dict[tuple[int, int], int] = {}
    for s in range(depth):
        stage_holes = sorted(p for p, hole_s in holes if hole_s == s)
        if stage_holes:
            extra = reroute_extra(microbatches, stage_holes)
            if extra is None:
                return None
            extras.update({(p, s): e for p, e in extra.items() if e})
    return extras


def _row_step(base: Sequence[float], row: Sequence[float | None], m: int, extras: Mapping[int, int],
              hidden: float) -> float:
    """One pipeline's step (module docstring): its slots' times `row` (None: a hole, which
    takes its `base` time in the fill), `extras[s]` rerouted microbatches at stage s."""
    fill = sum(base[s] if t is None else t for s, t in enumerate(row))
    own = [t for t in row if t is not None]
    plain = fill + (m - 1) * max(own, default=0.0)  # the hole-free 1F1B step of this pipeline
    worst = max(((m - 1) * t for t in own), default=0.0)
    for s, t in enumerate(row):
        e = extras.get(s, 0)
        if t is None or not e:
            continue
        work = e * t
        shown = work - min(hidden * work, max(0.0, plain - m * t))  # what the bubbles cannot hide
        worst = max(worst, (m - 1) * t + shown)
    return fill + worst
