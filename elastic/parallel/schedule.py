"""The 1F1B (PipeDream-Flush) pipeline schedule, generated as data.

A schedule is one list of actions per stage. Stage s of S first runs min(S-s-1, M) warm-up
forwards, then alternates one forward and one backward, then drains the remaining backwards,
so at most S-s microbatches hold activations at once. Transfers are explicit actions: a
forward on a non-first stage is preceded by receiving its activation, a backward on a non-last
stage by receiving its output gradient.

The executor posts the transfers as groups (`coalesce`): every run of consecutive transfer
actions between two computations is one group of point-to-point operations, which NCCL runs
together, as Megatron pairs "send forward, receive backward" and "send backward, receive
forward". Both neighbours post their halves of a link in matching groups, so no transfer waits
for a message that is only posted behind it (tests/engine/test_schedule.py checks every shape
under elastic/comm/nccl_model.py's rules).

`simulate` plays the schedules of all stages against each other at the level of data (which
microbatch each transfer carries, sends buffered, receives blocking) and reports a deadlock or a
mismatched transfer.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass


class Op(enum.Enum):
    RECV_ACT = "recv_act"
    FORWARD = "forward"
    SEND_ACT = "send_act"
    RECV_GRAD = "recv_grad"
    BACKWARD = "backward"
    SEND_GRAD = "send_grad"


TRANSFERS = frozenset({Op.RECV_ACT, Op.SEND_ACT, Op.RECV_GRAD, Op.SEND_GRAD})
"""The actions that move data between stages."""


@dataclass(frozen=True)
class Action:
    """One step of a stage's schedule, on microbatch `mb` (index inside the pipeline)."""

    op: Op
    mb: int

    def __str__(self) -> str:
        return f"{self.op.value}({self.mb})"


def one_f_one_b(*, num_stages: int, stage: int, microbatches: int) -> list[Action]:
    """The 1F1B actions of `stage` in a pipeline of `num_stages` stages over `microbatches`."""
    if num_stages < 1 or not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} outside a pipeline of {num_stages} stages")
    if microbatches < 1:
        raise ValueError(f"a pipeline needs at least one microbatch, got {microbatches}")
    first, last = stage == 0, stage == num_stages - 1

    def fwd(m: int) -> list[Action]:
        out = [] if first else [Action(Op.RECV_ACT, m)]
        out.append(Action(Op.FORWARD, m))
        if not last:
            out.append(Action(Op.SEND_ACT, m))
        return out

    def bwd(m: int) -> list[Action]:
        out = [] if last else [Action(Op.RECV_GRAD, m)]
        out.append(Action(Op.BACKWARD, m))
        if not first:
            out.append(Action(Op.SEND_GRAD, m))
        return out

    warmup = min(num_stages - stage - 1, microbatches)
    actions: list[Action] = []
    for m in range(warmup):
        actions += fwd(m)
    for i in range(microbatches - warmup):
        actions += fwd(warmup + i)
        actions += bwd(i)
    for m in range(microbatches - warmup, microbatches):
        actions += bwd(m)
    return actions


def forward_only(*, num_stages: int, stage: int, microbatches: int) -> list[Action]:
    """The actions of `stage` for a pass without backward (evaluation): every microbatch is
    received, forwarded and sent on in order. Sends never block, so no stage waits on a later one."""
    if num_stages < 1 or not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} outside a pipeline of {num_stages} stages")
    if microbatches < 1:
        raise ValueError(f"a pipeline needs at least one microbatch, got {microbatches}")
    actions: list[Action] = []
    for m in range(microbatches):
        if stage > 0:
            actions.append(Action(Op.RECV_ACT, m))
        actions.append(Action(Op.FORWARD, m))
        if stage < num_stages - 1:
            actions.append(Action(Op.SEND_ACT, m))
    return actions


def coalesce(actions: Sequence[Action]) -> list[tuple[Action, ...]]:
    """`actions` as the executor runs them: each computation alone, each run of consecutive
    transfers as one group posted together (module doc)."""
    out: list[tuple[Action, ...]] = []
    run: list[Action] = []
    for a in actions:
        if a.op in TRANSFERS:
            run.append(a)
            continue
        if run:
            out.append(tuple(run))
            run = []
        out.append((a,))
    if run:
        out.append(tuple(run))
    return out


class ScheduleError(RuntimeError):
    """A set of stage schedules that would deadlock or transfer the wrong thing."""


def simulate(schedules: Sequence[Sequence[Action]]) -> list[tuple[int, Action]]:
    """Run the stage schedules of one pipeline against each other.

    Sends are buffered (never block) and receives block until the matching send happened, as
    in the executor. Returns the global order of executed (stage, action); raises ScheduleError
    on deadlock, on a receive that would get a different microbatch than it expects, on a
    forward/backward whose input is missing, or on leftover undelivered messages.
    """
    n = len(schedules)
    # Channels: activations flow s -> s+1, gradients s+1 -> s. FIFO per channel, like p2p.
    acts: list[deque[int]] = [deque() for _ in range(n)]  # acts[s]: messages into stage s
    grads: list[deque[int]] = [deque() for _ in range(n)]  # grads[s]: messages into stage s
    pc = [0] * n
    have_input: list[set[int]] = [set() for _ in range(n)]
    have_out_grad: list[set[int]] = [set() for _ in range(n)]
    forwarded: list[set[int]] = [set() for _ in range(n)]
    order: list[tuple[int, Action]] = []

    def try_step(s: int) -> bool:
        a = schedules[s][pc[s]]
        if a.op is Op.RECV_ACT:
            if not acts[s]:
                return False
            got = acts[s].popleft()
            if got != a.mb:
                raise ScheduleError(f"stage {s} expected activation {a.mb} but the next one is {got}")
            have_input[s].add(a.mb)
        elif a.op is Op.RECV_GRAD:
            if not grads[s]:
                return False
            got = grads[s].popleft()
            if got != a.mb:
                raise ScheduleError(f"stage {s} expected gradient {a.mb} but the next one is {got}")
            have_out_grad[s].add(a.mb)
        elif a.op is Op.FORWARD:
            if s > 0 and a.mb not in have_input[s]:
                raise ScheduleError(f"stage {s} runs forward({a.mb}) before receiving its input")
            forwarded[s].add(a.mb)
        elif a.op is Op.BACKWARD:
            if a.mb not in forwarded[s]:
                raise ScheduleError(f"stage {s} runs backward({a.mb}) before forward({a.mb})")
            if s < n - 1 and a.mb not in have_out_grad[s]:
                raise ScheduleError(f"stage {s} runs backward({a.mb}) before receiving its gradient")
        elif a.op is Op.SEND_ACT:
            if s == n - 1:
                raise ScheduleError(f"last stage {s} sends an activation")
            acts[s + 1].append(a.mb)
        elif a.op is Op.SEND_GRAD:
            if s == 0:
                raise ScheduleError("first stage sends a gradient")
            grads[s - 1].append(a.mb)
        pc[s] += 1
        order.append((s, a))
        return True

    while any(pc[s] < len(schedules[s]) for s in range(n)):
        progressed = False
        for s in range(n):
            while pc[s] < len(schedules[s]) and try_step(s):
                progressed = True
        if not progressed:
            stuck = {s: str(schedules[s][pc[s]]) for s in range(n) if pc[s] < len(schedules[s])}
            raise ScheduleError(f"deadlock: stages blocked at {stuck}")
    left = [s for s in range(n) if acts[s] or grads[s]]
    if left:
        raise ScheduleError(f"messages never received by stages {left}")
    return order
