"""The pipeline schedule under NCCL's rules (elastic/comm/nccl_model.py), for every shape: the
executor's posting (each run of consecutive transfers one group, waited for before the next
computation) never deadlocks, and the posting of before (every transfer on its own, sends
waited for at the end of the step, receives at once) deadlocks as soon as a stage has two
microbatches to send while its neighbour sends back: row 2 of issue 31."""

from __future__ import annotations

import pytest

from elastic.comm import Event, Op
from elastic.comm.nccl_model import check
from elastic.parallel.interleaved import interleaved
from elastic.parallel.schedule import Action, coalesce, forward_only
from elastic.parallel.schedule import Op as Act
from tests.engine.schedules import pipeline_schedule

pytestmark = pytest.mark.timeout(120)

COMM = "g1/world"
_PEER = {Act.RECV_ACT: -1, Act.SEND_GRAD: -1, Act.SEND_ACT: 1, Act.RECV_GRAD: 1}
_TAG = {Act.RECV_ACT: 0, Act.SEND_ACT: 0, Act.RECV_GRAD: 1, Act.SEND_GRAD: 1}
_KIND = {Act.RECV_ACT: "recv", Act.RECV_GRAD: "recv", Act.SEND_ACT: "send", Act.SEND_GRAD: "send"}


class _Log:
    """One stage's log, built as the executor would record it (stage s is world rank s)."""

    def __init__(self, stage: int, stages: int) -> None:
        self.stages = stages
        self.stage, self.events, self.next = stage, [Event(lane="main", kind="create", comm=COMM,
                                                           members=tuple(range(stages)), rank=stage)], 0

    def op(self, a: Action) -> Op:
        self.next += 1
        peer = (self.stage + _PEER[a.op]) % self.stages  # a ring under interleaving
        return Op(id=self.next, kind=_KIND[a.op], peer=peer, nbytes=1 << 20, tag=_TAG[a.op])

    def post(self, ops: list[Op], *, grouped: bool) -> None:
        self.events.append(Event(lane="main", kind="post", comm=COMM, ops=tuple(ops), grouped=grouped))

    def wait(self, ops: list[Op]) -> None:
        self.events.append(Event(lane="main", kind="wait", ids=tuple(o.id for o in ops)))


def grouped_logs(schedules: list[list[Action]]) -> dict[int, list[Event]]:
    """The executor's posting: `coalesce`d groups, each waited for at once."""
    logs = {}
    for s, actions in enumerate(schedules):
        log = _Log(s, len(schedules))
        for step in coalesce(actions):
            if step[0].op in _KIND:
                ops = [log.op(a) for a in step]
                log.post(ops, grouped=True)
                log.wait(ops)
        logs[s] = log.events
    return logs


def old_logs(schedules: list[list[Action]]) -> dict[int, list[Event]]:
    """The posting before: one transfer at a time, receives waited for at once, sends at the end."""
    logs = {}
    for s, actions in enumerate(schedules):
        log = _Log(s, len(schedules))
        sends = []
        for a in actions:
            if a.op in _KIND:
                op = log.op(a)
                log.post([op], grouped=False)
                if op.kind == "recv":
                    log.wait([op])
                else:
                    sends.append(op)
        for op in sends:
            log.wait([op])
        logs[s] = log.events
    return logs


@pytest.mark.parametrize("stages", range(1, 9))
def test_the_grouped_schedule_never_deadlocks(stages: int) -> None:
    for mbs in range(1, 17):
        report = check(grouped_logs(pipeline_schedule(num_stages=stages, microbatches=mbs)))
        assert report.ok, f"{stages} stages, {mbs} microbatches:\n{report.describe()}"
        evaluation = [forward_only(num_stages=stages, stage=s, microbatches=mbs) for s in range(stages)]
        assert check(grouped_logs(evaluation)).ok


@pytest.mark.parametrize("stages", range(2, 5))
def test_the_old_posting_deadlocks_from_two_microbatches(stages: int) -> None:
    assert check(old_logs(pipeline_schedule(num_stages=stages, microbatches=1))).ok  # nothing to cross
    for mbs in range(2, 9):
        report = check(old_logs(pipeline_schedule(num_stages=stages, microbatches=mbs)))
        assert report.deadlock, f"{stages} stages, {mbs} microbatches"
        # Two neighbours, each at the head of its pair's queue with a send the other cannot take.
        heads = [s for s in report.stuck if "send(" in s.why and "send(" in s.why.split("whose head")[-1]]
        assert heads, report.describe()


@pytest.mark.parametrize("stages", range(2, 7))
def test_the_interleaved_schedule_never_deadlocks(stages: int) -> None:
    """Every shape of the interleaved schedule, m a multiple of p or not, p = 2 (both kinds of
    message on one link) included, and its forward-only form (evaluation)."""
    for chunks in (2, 3, 4):
        for mbs in range(1, 3 * stages + 2):
            schedules = [interleaved(num_stages=stages, stage=s, microbatches=mbs, chunks=chunks)
                         for s in range(stages)]
            report = check(grouped_logs(schedules))
            assert report.ok, f"{stages} stages x {chunks} chunks, {mbs} microbatches:\n{report.describe()}"
            forwards = [[a for a in actions if a.op in (Act.RECV_ACT, Act.FORWARD, Act.SEND_ACT)]
                        for actions in schedules]
            assert check(grouped_logs(forwards)).ok


def test_the_model_sees_a_ring_link_that_carries_both_kinds_out_of_order() -> None:
    """With p = 2, activations and gradients share each link: a group posting them in the other
    order than its peer moves the wrong bytes, and the model says so (tags differ)."""
    schedules = [interleaved(num_stages=2, stage=s, microbatches=4, chunks=2) for s in range(2)]
    swapped = []
    for step in coalesce(schedules[0]):
        ops = list(step)
        if len(ops) > 1 and {a.op for a in ops} >= {Act.SEND_ACT, Act.SEND_GRAD}:
            i, j = next(k for k, a in enumerate(ops) if a.op is Act.SEND_ACT), next(
                k for k, a in enumerate(ops) if a.op is Act.SEND_GRAD)
            ops[i], ops[j] = ops[j], ops[i]
        swapped += ops
    assert swapped != schedules[0]
    assert not check(grouped_logs([swapped, schedules[1]])).ok
