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
    """One step of a stage's schedule, on microbatch `mb` (index inside the pipeline) and, under
    the interleaved schedule, model chunk `chunk` of the stage (elastic/parallel/interleaved.py)."""

    op: Op
    mb: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.op.value}({self.mb})" if self.chunk == 0 else f"{self.op.value}({self.mb}@{self.chunk})"


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
    in the executor. Links are a ring under interleaving: chunk c of the last stage sends its
    activation to chunk c + 1 of the first. Each ordered pair of stages is one FIFO channel for
    both kinds of message (NCCL matches the n-th send to the n-th receive whatever it carries).
    Returns the global order of executed (stage, action); raises ScheduleError on deadlock, on
    a receive that would get a different message than it expects, on a forward/backward whose
    input is missing, or on leftover undelivered messages.
    """
    run = _Simulation(schedules)
    n = len(schedules)
    while any(run.pc[s] < len(schedules[s]) for s in range(n)):
        progressed = False
        for s in range(n):
            while run.pc[s] < len(schedules[s]) and run.step(s):
                progressed = True
        if not progressed:
            stuck = {s: str(schedules[s][run.pc[s]]) for s in range(n) if run.pc[s] < len(schedules[s])}
            raise ScheduleError(f"deadlock: stages blocked at {stuck}")
    left = sorted({dst for (_, dst), queue in run.channels.items() if queue})
    if left:
        raise ScheduleError(f"messages never received by stages {left}")
    return run.order


class _Simulation:
    """The state of `simulate`: each stage's position and what it received and computed."""

    def __init__(self, schedules: Sequence[Sequence[Action]]) -> None:
        self.schedules, n = schedules, len(schedules)
        self.v = 1 + max((a.chunk for actions in schedules for a in actions), default=0)
        self.channels: dict[tuple[int, int], deque[tuple[str, int, int]]] = {}
        self.pc = [0] * n
        self.have_input: list[set[tuple[int, int]]] = [set() for _ in range(n)]
        self.have_out_grad: list[set[tuple[int, int]]] = [set() for _ in range(n)]
        self.forwarded: list[set[tuple[int, int]]] = [set() for _ in range(n)]
        self.order: list[tuple[int, Action]] = []

    def receive(self, s: int, src: int, want: tuple[str, int, int]) -> bool:
        queue = self.channels.get((src, s))
        if not queue:
            return False
        got = queue.popleft()
        if got != want:
            raise ScheduleError(f"stage {s} expected {want[0]} {want[2]}@{want[1]} from stage {src} but the "
                                f"next message is {got[0]} {got[2]}@{got[1]}")
        return True

    def step(self, s: int) -> bool:
        """Run stage `s`'s next action; False when it is a receive with nothing to receive yet."""
        n = len(self.schedules)
        a = self.schedules[s][self.pc[s]]
        key = (a.chunk, a.mb)
        first, last = s == 0 and a.chunk == 0, s == n - 1 and a.chunk == self.v - 1
        if a.op in (Op.RECV_ACT, Op.SEND_GRAD) and first:
            raise ScheduleError(f"first stage {s} runs {a}")
        if a.op in (Op.RECV_GRAD, Op.SEND_ACT) and last:
            raise ScheduleError(f"last stage {s} runs {a}")
        if a.op is Op.RECV_ACT:
            if not self.receive(s, (s - 1) % n, ("act", a.chunk, a.mb)):
                return False
            self.have_input[s].add(key)
        elif a.op is Op.RECV_GRAD:
            if not self.receive(s, (s + 1) % n, ("grad", a.chunk, a.mb)):
                return False
            self.have_out_grad[s].add(key)
        elif a.op is Op.FORWARD:
            if not first and key not in self.have_input[s]:
                raise ScheduleError(f"stage {s} runs {a} before receiving its input")
            self.forwarded[s].add(key)
        elif a.op is Op.BACKWARD:
            if key not in self.forwarded[s]:
                raise ScheduleError(f"stage {s} runs {a} before its forward")
            if not last and key not in self.have_out_grad[s]:
                raise ScheduleError(f"stage {s} runs {a} before receiving its gradient")
        elif a.op is Op.SEND_ACT:
            dst = (s + 1) % n
            self.channels.setdefault((s, dst), deque()).append(("act", a.chunk + (dst == 0), a.mb))
        else:
            dst = (s - 1) % n
            self.channels.setdefault((s, dst), deque()).append(("grad", a.chunk - (s == 0), a.mb))
        self.pc[s] += 1
        self.order.append((s, a))
        return True
