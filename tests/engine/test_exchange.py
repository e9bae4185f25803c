"""The tree exchange's thread, on real gloo groups (two ranks: threads of this process): its
results are the sums in the step's summation tree, step after step on one kept thread; an abort ends
`finish` at once and the abandoned exchange never writes its result afterwards, even when the
peer's data arrives; a failed transfer reaches the caller as itself; an idle thread ends."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from elastic.comm import Communicator
from elastic.parallel import exchange as exchange_module
from elastic.parallel.abort import AbortSignal, StepAborted
from elastic.parallel.blocks import Block, CombineProgram
from elastic.parallel.exchange import TreeBucket, TreeExchange
from tests.comm.support import gloo_comms
from tests.engine.test_vote import _both

pytestmark = pytest.mark.timeout(60)

N = 10_000
"""Elements of a bucket (a multiple of the two holders)."""


def _groups(timeout_s: float = 20) -> list[Communicator]:
    return gloo_comms(2, name="g1/0-1", timeout_s=timeout_s)


BLOCKS = ((Block(0, 1),), (Block(1, 1),))
"""One block per holder: the common step."""


def _bucket(rank: int, flat: torch.Tensor | tuple[torch.Tensor, ...], result: torch.Tensor,
            group: Communicator, norm: torch.Tensor | None = None, chunk: int | None = None,
            blocks: tuple[tuple[Block, ...], ...] = BLOCKS) -> TreeBucket:
    sums = flat if isinstance(flat, tuple) else (flat,)
    half = sums[0].numel() // 2
    peer = 1 - rank
    received = tuple(torch.empty(half) for _ in blocks[peer])
    program = CombineProgram([b for theirs in blocks for b in theirs])
    return TreeBucket(sums=sums, result=result, group=group, me=rank, tag=0, blocks=blocks,
                      received=(None, received) if rank == 0 else (received, None),
                      scratch=tuple(torch.empty(chunk or half) for _ in range(program.scratch)),
                      wide=torch.empty(chunk or half, dtype=torch.float64), norm=norm)


def _sums(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(N, generator=gen, dtype=torch.float32) * 10.0 ** (r - 3) for r in range(2)]


def test_every_step_is_the_tree_sum_on_one_kept_thread() -> None:
    groups = _groups()
    exchanges = [TreeExchange(), TreeExchange()]
    threads = []
    norms = [torch.full((), float("nan"), dtype=torch.float64) for _ in range(2)]
    for step in range(3):
        sums = _sums(step)
        results = [torch.full((N,), float("nan")) for _ in range(2)]

        def run(r: int, sums: list[torch.Tensor] = sums, results: list[torch.Tensor] = results) -> None:
            # A scratch shorter than a slice, not dividing it: the combine runs in chunks.
            exchanges[r].submit(_bucket(r, sums[r], results[r], groups[r], norm=norms[r], chunk=768))
            exchanges[r].finish(None)

        assert _both(run) == [None, None]
        expected = sums[0] + sums[1]
        assert torch.equal(results[0], expected) and torch.equal(results[1], expected)
        # Each holder measured its own slice of the result; together, the whole gradient once.
        for r, mine in enumerate(expected.double().chunk(2)):
            assert norms[r].item() == pytest.approx(mine.square().sum().item(), rel=1e-12)
        total = expected.double().square().sum().item()
        assert norms[0].item() + norms[1].item() == pytest.approx(total, rel=1e-12)
        threads.append(exchanges[0]._thread)  # noqa: SLF001 - the kept thread
    assert threads[0] is not None and threads[0] is threads[1] is threads[2]


def test_holders_with_several_blocks_combine_in_tree_order() -> None:
    """Holder 0 sums microbatches 0-2 as blocks (0, 2) and (2, 1), holder 1 microbatch 3: the
    result is (m0 + m1) + (m2 + m3), not the sum of the two holders' shares."""
    groups = _groups()
    gen = torch.Generator().manual_seed(11)
    mbs = [torch.randn(N, generator=gen) * 10.0 ** torch.randint(-6, 2, (N,), generator=gen).float() for _ in range(4)]
    blocks = ((Block(0, 2), Block(2, 1)), (Block(3, 1),))
    mine = [(mbs[0] + mbs[1], mbs[2]), (mbs[3],)]
    results = [torch.full((N,), float("nan")) for _ in range(2)]
    exchanges = [TreeExchange(), TreeExchange()]

    def run(r: int) -> None:
        exchanges[r].submit(_bucket(r, tuple(mine[r]), results[r], groups[r], blocks=blocks, chunk=1000))
        exchanges[r].finish(None)

    assert _both(run) == [None, None]
    expected = (mbs[0] + mbs[1]) + (mbs[2] + mbs[3])
    assert not torch.equal(expected, (mbs[0] + mbs[1] + mbs[2]) + mbs[3])
    assert torch.equal(results[0], expected) and torch.equal(results[1], expected)


def test_an_abort_ends_finish_and_the_abandoned_exchange_writes_nothing_after() -> None:
    groups = _groups()
    aborts = [AbortSignal(), AbortSignal()]
    exchanges = [TreeExchange(), TreeExchange()]
    sums = _sums(7)
    results = [torch.full((N,), float("nan")) for _ in range(2)]

    # Rank 1 is silent: rank 0 waits for its first phase until the abort.
    threading.Timer(0.3, aborts[0].set, args=("peer lost",)).start()
    exchanges[0].submit(_bucket(0, sums[0], results[0], groups[0]))
    start = time.monotonic()
    with pytest.raises(StepAborted, match="peer lost"):
        exchanges[0].finish(aborts[0])
    assert time.monotonic() - start < 5
    assert exchanges[0].abandoned
    with pytest.raises(RuntimeError, match="abandoned"):
        exchanges[0].submit(_bucket(0, sums[0], results[0], groups[0]))

    # Rank 1 turns up: rank 0's first phase completes now, but its thread must not sum into the
    # result any more (and sends no second phase: rank 1 waits until its own abort).
    threading.Timer(1.0, aborts[1].set, args=("peer gone quiet",)).start()
    exchanges[1].submit(_bucket(1, sums[1], results[1], groups[1]))
    with pytest.raises(StepAborted, match="peer gone quiet"):
        exchanges[1].finish(aborts[1])
    assert torch.isnan(results[0]).all()

    # Closing the groups fails rank 1's transfer still waiting for rank 0's second phase: both
    # abandoned exchanges' threads end then (not after IDLE_EXIT_S, nor at the group's timeout).
    threads = [e._thread for e in exchanges]  # noqa: SLF001 - the threads of the abandoned exchanges
    for group in groups:
        group.shutdown()
    for thread in threads:
        if thread is not None:
            thread.join(3)
            assert not thread.is_alive()


def test_a_failed_transfer_reaches_the_caller_as_itself() -> None:
    groups = _groups(timeout_s=1)  # the silent peer's transfer times out with its group
    exchange = TreeExchange()
    sums = _sums(3)
    result = torch.full((N,), float("nan"))
    exchange.submit(_bucket(0, sums[0], result, groups[0]))
    with pytest.raises(RuntimeError, match="[Tt]imed out") as failed:
        exchange.finish(AbortSignal())
    assert not isinstance(failed.value, StepAborted)
    assert exchange.abandoned
    with pytest.raises(RuntimeError) as again:
        exchange.submit(_bucket(0, sums[0], result, groups[0]))
    assert again.value is failed.value
    assert torch.isnan(result).all()
    groups[1].shutdown()


def test_an_idle_thread_ends_and_the_next_step_starts_another(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(exchange_module, "IDLE_EXIT_S", 0.2)
    groups = _groups()
    exchanges = [TreeExchange(), TreeExchange()]
    for step in range(2):
        sums = _sums(step)
        results = [torch.empty(N) for _ in range(2)]

        def run(r: int, sums: list[torch.Tensor] = sums, results: list[torch.Tensor] = results) -> None:
            exchanges[r].submit(_bucket(r, sums[r], results[r], groups[r]))
            exchanges[r].finish(None)

        assert _both(run) == [None, None]
        assert torch.equal(results[1], sums[0] + sums[1])
        thread = exchanges[0]._thread  # noqa: SLF001 - the thread of this step
        assert thread is not None
        thread.join(5)
        assert not thread.is_alive() and exchanges[0]._thread is None  # noqa: SLF001
