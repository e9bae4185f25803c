"""The interleaved 1F1B schedule (Narayanan et al., 2021), generated as data.

Each of a pipeline's p stages holds v model chunks; chunk c of stage s is virtual stage
c * p + s, so a microbatch passes every stage v times, and the bubble shrinks from (p - 1) / m
of a step to (p - 1) / (v * m) at the price of v times as many transfers.

The order of the computations follows Megatron-core's schedule table. Microbatches go in groups
of p; a stage runs the forwards of a group chunk by chunk, and the backwards of a group in the
same order with the chunks reversed. Stage s warms up with (p - s - 1) * 2 + (v - 1) * p
forwards (all of them when m = p), then alternates one forward and one backward, then drains
the backwards. The first stage thus holds up to (v - 1) * p + 2 (p - 1) + 1 chunk-microbatches'
activations, more than 1F1B's p: the memory the interleaving costs.

Where p does not divide m, the schedule is the one for m' = ceil(m / p) * p microbatches with
the missing m' - m left out on every stage (as Megatron-core pads its last group): the order of
what remains is a valid order of the full schedule, so it cannot deadlock, and it holds no more
in flight. The missing microbatches still cost (v - 1) / v of their slot each: with stages of
equal time t (forward and backward) a step takes t (m + (p - 1) / v + (m' - m)(v - 1) / v), the
formula of `templates.cost.pipeline_time`, which tests/engine/test_schedule.py checks against
this schedule played out. For m < p, m' = p.

Transfers are placed as Megatron posts them: each slot (a warm-up forward, a steady forward
and backward, a cool-down backward) is followed by one run of transfers that sends the slot's
outputs and receives the next slot's inputs, which the executor posts as one group
(`schedule.coalesce`). Sends go before receives, activations before gradients, so two stages
that exchange both kinds (p = 2) post them in the same order.

With v = 1 this is `one_f_one_b`, which is kept as it is.
"""

from __future__ import annotations

from elastic.parallel.schedule import Action, Op, one_f_one_b


def chunk_table(*, num_stages: int, microbatches: int, chunks: int) -> list[tuple[int, int]]:
    """(microbatch, chunk) of each forward in order: groups of `num_stages` microbatches, each
    group chunk by chunk (the last group holds what is left)."""
    table: list[tuple[int, int]] = []
    for lo in range(0, microbatches, num_stages):
        hi = min(lo + num_stages, microbatches)
        table += [(mb, c) for c in range(chunks) for mb in range(lo, hi)]
    return table


def warmup_count(*, num_stages: int, stage: int, microbatches: int, chunks: int) -> int:
    """Forwards stage `stage` runs before its first backward, for m a multiple of p (Megatron's
    count; all of them when m = p)."""
    total = microbatches * chunks
    if microbatches == num_stages:
        return total
    return min((num_stages - stage - 1) * 2 + (chunks - 1) * num_stages, total)


def interleaved(*, num_stages: int, stage: int, microbatches: int, chunks: int) -> list[Action]:
    """The interleaved 1F1B actions of `stage` in a pipeline of `num_stages` stages, `chunks`
    model chunks each, over `microbatches` (module doc)."""
    if chunks < 1:
        raise ValueError(f"a stage holds at least one model chunk, got {chunks}")
    if chunks == 1:
        return one_f_one_b(num_stages=num_stages, stage=stage, microbatches=microbatches)
    if num_stages < 2 or not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} outside a pipeline of {num_stages} stages (interleaving needs 2 or more)")
    if microbatches < 1:
        raise ValueError(f"a pipeline needs at least one microbatch, got {microbatches}")
    padded = -(-microbatches // num_stages) * num_stages
    warm = warmup_count(num_stages=num_stages, stage=stage, microbatches=padded, chunks=chunks)
    actions = _actions(num_stages, stage, padded, chunks, warm)
    return [a for a in actions if a.mb < microbatches]


def _actions(num_stages: int, stage: int, microbatches: int, chunks: int, warm: int) -> list[Action]:
    """The actions of `stage` with `warm` warm-up forwards."""
    first, last = stage == 0, stage == num_stages - 1
    fwd = chunk_table(num_stages=num_stages, microbatches=microbatches, chunks=chunks)
    bwd = [(mb, chunks - 1 - c) for mb, c in fwd]
    total = len(fwd)
    # Each slot: (forward index or None, backward index or None).
    slots: list[tuple[int | None, int | None]] = [(i, None) for i in range(warm)] + [(warm + k, k) for k in range(total - warm)]
    slots += [(None, k) for k in range(total - warm, total)]

    def needs(slot: tuple[int | None, int | None]) -> list[Action]:
        f, b = slot
        out = []
        if f is not None and not (first and fwd[f][1] == 0):
            out.append(Action(Op.RECV_ACT, *fwd[f]))
        if b is not None and not (last and bwd[b][1] == chunks - 1):
            out.append(Action(Op.RECV_GRAD, *bwd[b]))
        return out

    actions = needs(slots[0])
    for i, (f, b) in enumerate(slots):
        sends = []
        if f is not None:
            actions.append(Action(Op.FORWARD, *fwd[f]))
            if not (last and fwd[f][1] == chunks - 1):
                sends.append(Action(Op.SEND_ACT, *fwd[f]))
        if b is not None:
            actions.append(Action(Op.BACKWARD, *bwd[b]))
            if not (first and bwd[b][1] == 0):
                sends.append(Action(Op.SEND_GRAD, *bwd[b]))
        actions += sends + (needs(slots[i + 1]) if i + 1 < len(slots) else [])
    return actions
