"""The pipeline schedule under NCCL's rules (elastic/comm/nccl_model.py), for every shape: the
executor's posting (each run of consecutive transfers one group, waited for before the next
computation) never deadlocks, and the posting of before (every transfer on its own, sends
waited for at the end of the step, receives at once) deadlocks as soon as a stage has two
microbatches to send while its neighbour sends back: row 2 of issue 31."""

from __future__ import annotations

import pytest

from elastic.comm import Event, Op
from elastic.comm.nccl_model import check
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
        self.stage, self.events, self.next = stage, [Event(lane="main", kind="create", comm=COMM,
                                                           members=tuple(range(stages)), rank=stage)], 0

    def op(self, a: Action) -> Op:
        self.next += 1
        return Op(id=self.next, kind=_KIND[a.op], peer=self.stage + _PEER[a.op], nbytes=1 << 20, tag=_TAG[a.op])

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
