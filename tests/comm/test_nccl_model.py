"""The model of NCCL (elastic/comm/nccl_model.py) on logs of real gloo communicators (threads of
this process, every operation recorded): it finds the deadlocks of rows 1 and 5 of issue 31 in
the posting orders of before (which gloo happens to run to the end), finds none in the code that
replaced them (the tree exchange and the shard exchange themselves, on 2-4 ranks), and reports
pairs that NCCL would mismatch, collectives posted in different orders, posts on an aborted
communicator and operations left pending."""

from __future__ import annotations

import threading

import pytest
import torch

from elastic.comm import NONBLOCKING_ENV, P2P, Communicator, Event, Handle, Op, Recorder
from elastic.comm.nccl_model import check
from elastic.parallel.blocks import Block, CombineProgram
from elastic.parallel.exchange import TreeBucket, TreeExchange
from elastic.transfer.collective import ShardMove, exchange
from elastic.transfer.shards import ShardKey
from tests.comm.support import gloo_comms, on_threads

pytestmark = pytest.mark.timeout(120)


def _run(n: int, body: object, *, name: str = "g1/world") -> dict[int, list]:
    """`body(rank, comm)` on n threads over one recording gloo communicator; the logs."""
    recorders = [Recorder(rank=r) for r in range(n)]
    comms = gloo_comms(n, name=name, recorders=recorders)
    results = on_threads(n, lambda r: body(r, comms[r]))  # type: ignore[operator]
    errors = [e for e in results if isinstance(e, BaseException)]
    assert not errors, errors
    return {r: recorders[r].snapshot() for r in range(n)}


# ---- row 1: the tree exchange ------------------------------------------------------------------


def old_tree_exchange(rank: int, comm: Communicator) -> None:
    """Before: for every other holder, a receive then a send, each on its own; waited at the end."""
    mine = torch.full((comm.size << 10,), float(rank))
    works = []
    for j in range(comm.size):
        if j != rank:
            works.append(comm.post_ungrouped(P2P("recv", torch.empty(mine.numel() // comm.size), j)))
            works.append(comm.post_ungrouped(P2P("send", mine.chunk(comm.size)[j].contiguous(), j)))
    for w in works:
        w.wait()


@pytest.mark.parametrize("holders", [2, 3, 4])
def test_the_old_tree_exchange_deadlocks(holders: int) -> None:
    report = check(_run(holders, old_tree_exchange))
    assert report.deadlock
    # Every holder waits in a receive whose peer is at a receive too.
    assert all("recv(" in s.why and "head" in s.why for s in report.stuck if s.event.kind == "wait"), report.describe()


def tree_bucket(rank: int, holders: int, comm: Communicator, sums: torch.Tensor, result: torch.Tensor) -> TreeBucket:
    blocks = tuple((Block(j, 1),) for j in range(holders))
    n = sums.numel() // holders
    return TreeBucket(sums=(sums,), result=result, blocks=blocks, group=comm, me=rank, tag=0,
                      received=tuple(None if j == rank else (torch.empty(n),) for j in range(holders)),
                      scratch=tuple(torch.empty(n) for _ in range(CombineProgram(list(Block(j, 1) for j in range(holders))).scratch)),
                      wide=torch.empty(n, dtype=torch.float64), norm=torch.zeros((), dtype=torch.float64))


@pytest.mark.parametrize("holders", [2, 3, 4])
def test_the_tree_exchange_of_now_keeps_nccls_rules(holders: int) -> None:
    """Three buckets a step, two steps, on one kept thread: the real `TreeExchange`."""
    n = 96 * holders
    out: dict[int, list[torch.Tensor]] = {}

    def body(rank: int, comm: Communicator) -> None:
        exchange_ = TreeExchange(recorder=comm.recorder)
        results = []
        for step in range(2):
            for bucket in range(3):
                sums = torch.full((n,), float(rank + 10 * bucket + 100 * step))
                results.append(torch.empty(n))
                exchange_.submit(tree_bucket(rank, holders, comm, sums, results[-1]))
            exchange_.finish(None)
        out[rank] = results

    report = check(_run(holders, body, name=f"g1/{holders}-holders"))
    assert report.ok, report.describe()
    for k, result in enumerate(out[0]):  # and the sums are right
        step, bucket = divmod(k, 3)
        assert torch.equal(result, torch.full((n,), float(sum(range(holders)) + holders * (10 * bucket + 100 * step))))


# ---- row 5: the shard exchange ------------------------------------------------------------------

TWO_WAY = [(0, 1), (1, 0)]
ROTATION = [(0, 1), (1, 2), (2, 0)]


def old_shard_exchange(pairs: list[tuple[int, int]]) -> object:
    """Before: every send (header, then data) on its own, then the header receives, then the data."""

    def body(rank: int, comm: Communicator) -> None:
        sends: list[Handle] = []
        for src, dst in pairs:
            if src == rank:
                sends.append(comm.post_ungrouped(P2P("send", torch.zeros(64), dst)))
                sends.append(comm.post_ungrouped(P2P("send", torch.ones(1024), dst)))
        for src, dst in pairs:
            if dst == rank:
                comm.post_ungrouped(P2P("recv", torch.empty(64), src)).wait()
                comm.post_ungrouped(P2P("recv", torch.empty(1024), src)).wait()
        for w in sends:
            w.wait()

    return body


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "lazy"])
@pytest.mark.parametrize("pairs", [TWO_WAY, ROTATION], ids=["two-way", "rotation"])
def test_the_old_shard_exchange_deadlocks(
    pairs: list[tuple[int, int]], eager: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In both NCCL modes (elastic/comm/opening.py): connected eagerly, each rank's receives wait
    behind its own sends on the group's one queue; lazily, each rank blocks creating its pair's
    communicator with the next, who creates with the next."""
    monkeypatch.setenv(NONBLOCKING_ENV, "0" if eager else "1")
    report = check(_run(max(max(p) for p in pairs) + 1, old_shard_exchange(pairs)))
    assert report.deadlock, report.describe()
    if pairs == ROTATION:
        why = "earlier unit(s) [[send(" if eager else "pair communicator"
        assert {s.worker for s in report.stuck if why in s.why} == {0, 1, 2}, report.describe()


def shard(key: ShardKey) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(key.layer)
    return {"param/w": torch.randn(16, 8, generator=g), "exp_avg/w": torch.randn(16, 8, generator=g),
            "step": torch.tensor(3)}


@pytest.mark.parametrize("pairs", [TWO_WAY, ROTATION, [(0, 1), (0, 2), (1, 0), (2, 1), (3, 0), (0, 3)]],
                         ids=["two-way", "rotation", "mixed"])
def test_the_shard_exchange_of_now_keeps_nccls_rules(pairs: list[tuple[int, int]]) -> None:
    """The real `exchange`: shards moved both ways and around a cycle, each verified on arrival."""
    moves = [ShardMove(key=ShardKey(10 * src + dst, 0), src=src, dst=dst) for src, dst in pairs]
    got: dict[int, object] = {}

    def body(rank: int, comm: Communicator) -> None:
        got[rank] = exchange(comm, rank=rank, moves=moves, export=shard, wait=lambda h: h.wait())

    report = check(_run(max(max(p) for p in pairs) + 1, body))
    assert report.ok, report.describe()
    for m in moves:
        received = got[m.dst].shards[m.key]  # type: ignore[attr-defined]
        assert all(torch.equal(received[k], v) for k, v in shard(m.key).items())


# ---- what else the model reports ------------------------------------------------------------------


def test_a_pair_matched_by_order_with_other_tags_is_reported() -> None:
    """gloo matches by tag, so this runs; NCCL matches by order and would swap the two tensors."""

    def body(rank: int, comm: Communicator) -> None:
        if rank == 0:
            comm.post([P2P("send", torch.zeros(8), 1, tag=1), P2P("send", torch.ones(8), 1, tag=2)]).wait()
        else:
            a, b = torch.empty(8), torch.empty(8)
            comm.post([P2P("recv", b, 0, tag=2), P2P("recv", a, 0, tag=1)]).wait()

    report = check(_run(2, body))
    assert not report.deadlock and any("mismatched pair" in p for p in report.problems), report.describe()


def test_collectives_posted_in_different_orders_are_reported() -> None:
    """(A log written by hand: gloo itself would hang on this one.) Rank 0 posts the vote, then an
    evaluation's all-reduce; rank 1 the other way round."""

    def log(rank: int, sizes: list[int]) -> list[Event]:
        ops = [Op(id=i + 1, kind="all_reduce", nbytes=n) for i, n in enumerate(sizes)]
        return [Event(lane="main", kind="create", comm="g1/world", members=(0, 1), rank=rank),
                *(Event(lane="main", kind="post", comm="g1/world", ops=(op,)) for op in ops),
                Event(lane="main", kind="wait", ids=tuple(op.id for op in ops))]

    report = check({0: log(0, [32, 8]), 1: log(1, [8, 32])})
    assert any("different collectives" in p for p in report.problems), report.describe()


def test_a_post_after_an_abort_fails_and_a_pending_operation_is_reported() -> None:
    def body(rank: int, comm: Communicator) -> None:
        if rank == 0:
            comm.post([P2P("send", torch.ones(4), 1)])  # never received: pending on a live communicator
            return
        comm.abort()
        with pytest.raises(RuntimeError, match="aborted"):
            comm.post([P2P("recv", torch.empty(4), 0)])

    logs = _run(2, body)
    assert not any(e.kind == "post" for e in logs[1]), "a refused post is not logged"
    report = check(logs)
    assert any("left pending" in p for p in report.problems), report.describe()


# ---- the two rules of issue 60 ------------------------------------------------------------------


def test_a_communicator_posted_from_two_lanes_is_reported() -> None:
    """Rank 0 posts its two all-reduces from two threads, one after the other (gloo runs it);
    NCCL's group state would be shared by two threads. From one thread the same passes."""

    def body(two_lanes: bool) -> object:
        def run(rank: int, comm: Communicator) -> None:
            first = comm.all_reduce(torch.ones(4))
            if rank == 0 and two_lanes:
                out: list[Handle] = []
                t = threading.Thread(target=lambda: out.append(comm.all_reduce(torch.ones(4))), name="helper")
                t.start()
                t.join()
                second = out[0]
            else:
                second = comm.all_reduce(torch.ones(4))
            first.wait()
            second.wait()

        return run

    report = check(_run(2, body(True)))
    assert any("posted from 2 lanes" in p and "'helper'" in p for p in report.problems), report.describe()
    assert check(_run(2, body(False))).ok


def _ungrouped_after_a_collective(rank: int, comm: Communicator) -> None:
    """Rank 0: an all-reduce, then an ungrouped send; rank 1: the ungrouped receive first."""
    if rank == 0:
        handles = [comm.all_reduce(torch.ones(4)), comm.post_ungrouped(P2P("send", torch.ones(4), 1))]
    else:
        handles = [comm.post_ungrouped(P2P("recv", torch.empty(4), 0)), comm.all_reduce(torch.ones(4))]
    for h in handles:
        h.wait()


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "lazy"])
def test_an_ungrouped_operation_on_an_eager_group_queues_behind_its_collectives(
    eager: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Connected eagerly, the receive is rank 1's head on the group's queue and rank 0's head is
    the all-reduce: a deadlock. Connected lazily, the pair runs on a communicator of its own and
    nothing waits (the rule of before, which the eager connect makes wrong)."""
    monkeypatch.setenv(NONBLOCKING_ENV, "0" if eager else "1")
    report = check(_run(2, _ungrouped_after_a_collective))
    if eager:
        assert report.deadlock, report.describe()
        assert any("recv(peer 0" in s.why and "all_reduce" in s.why for s in report.stuck), report.describe()
    else:
        assert report.ok, report.describe()
