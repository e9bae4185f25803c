"""`Handle.split` (elastic/comm/communicator.py) on real gloo communicators: a rank waits for the
receives of a group without waiting for its sends, which on gloo complete only once the peer
posted the matching receive (the executor's deferred send waits, elastic/parallel/executor.py).
Rank 1 posts its receive only after rank 0 got what it was sent: a wait on the whole group would
deadlock there. Recorded groups (and NCCL's) stay whole."""

from __future__ import annotations

import threading

import pytest
import torch

from elastic.comm import P2P, Recorder
from tests.comm.support import gloo_comms, on_threads

pytestmark = pytest.mark.timeout(60)


def test_the_receives_of_a_group_complete_before_its_sends() -> None:
    comms = gloo_comms(2)
    got = threading.Event()

    def rank(r: int) -> list[float]:
        comm = comms[r]
        out, into = torch.full((4,), float(r + 1)), torch.zeros(4)
        if r == 0:
            handle = comm.post([P2P("send", out, 1), P2P("recv", into, 1)])
            now, later = handle.split([1])
            now.wait()
            got.set()  # rank 1 has not posted the receive of our send yet
            later.wait()
            return into.tolist()
        sent = comm.post([P2P("send", out, 0)])
        assert got.wait(30), "rank 0 never got its receive without waiting for its send"
        comm.post([P2P("recv", into, 0)]).wait()
        sent.wait()
        return into.tolist()

    assert on_threads(2, rank) == [[2.0] * 4, [1.0] * 4]
    for c in comms:
        c.shutdown()


def test_a_recorded_group_is_not_split() -> None:
    comms = gloo_comms(2, recorders=[Recorder(rank=0), Recorder(rank=1)])

    def rank(r: int) -> bool:
        out, into = torch.ones(2), torch.zeros(2)
        handle = comms[r].post([P2P("send", out, 1 - r), P2P("recv", into, 1 - r)])
        now, later = handle.split([1])
        now.wait()
        later.wait()
        return now is handle and later.is_completed() and handle.is_completed()

    assert on_threads(2, rank) == [True, True]
    for c in comms:
        c.shutdown()
