"""Test helpers over schedules as data: every stage's 1F1B list of one pipeline, and how many
microbatches' activations a stage holds at once."""

from __future__ import annotations

from collections.abc import Sequence

from elastic.parallel.schedule import Action, Op, one_f_one_b


def pipeline_schedule(*, num_stages: int, microbatches: int) -> list[list[Action]]:
    """The 1F1B schedules of every stage of one pipeline."""
    return [one_f_one_b(num_stages=num_stages, stage=s, microbatches=microbatches) for s in range(num_stages)]


def peak_in_flight(actions: Sequence[Action]) -> int:
    """Most microbatches whose activations a stage holds at once (forwarded, not backwarded)."""
    live = peak = 0
    for a in actions:
        if a.op is Op.FORWARD:
            live += 1
            peak = max(peak, live)
        elif a.op is Op.BACKWARD:
            live -= 1
    return peak
