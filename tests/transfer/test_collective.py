"""The collective shard transfer: shards moved over a real gloo group between real processes
arrive bit-identical to the sender's (compared against a reference rebuilt from the same seed
here), corruption is caught by the checksum and the receiver's verification, the assignment of
moves is deterministic and balanced, and errors of the group reach the caller unchanged."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import random
import time
from datetime import timedelta
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from elastic.comm import Communicator, Handle, open_communicator
from elastic.parallel.abort import AbortSignal, StepAborted, wait_work
from elastic.transfer import shard_header
from elastic.transfer.collective import HEADER_FRAME_BYTES, exchange
from elastic.transfer.moves import ShardMove, assign_moves
from elastic.transfer.shard_header import (
    CHECKSUM_CHUNK_WORDS,
    ProtocolError,
    ShardHeader,
    ShardState,
    decode_header,
    describe_shard,
    encode_header,
    tensor_checksum,
    verify_shard,
)
from elastic.transfer.shards import ShardKey
from tests.processes import run_processes
from tests.transfer.shard_data import bit_equal

TIMEOUT = timedelta(seconds=40)
"""The store's and the groups' timeout. Spawned ranks of the niced background lane can start tens
of seconds apart on a loaded machine; a test that checks an error is seen, not timed out, measures
inside the rank, after the group is made."""

# Three ranks: 0 and 1 hold the shards; 1 and 2 need some, and so does 0 (0 <-> 1 both ways).
HOLDERS: dict[ShardKey, list[int]] = {
    ShardKey(0, 0): [0],
    ShardKey(1, 0): [0],
    ShardKey(2, 0): [1],
    ShardKey(2, 1): [1],
    ShardKey(3, 0): [0, 1],
    ShardKey(4, 0): [0],  # rank 0's export raises for this one
    ShardKey(5, 0): [1],  # 700 tensors: its header outgrows the first frame
}
NEEDS: dict[int, list[ShardKey]] = {
    0: [ShardKey(2, 0), ShardKey(5, 0)],
    1: [ShardKey(1, 0), ShardKey(0, 0), ShardKey(4, 0)],
    2: [ShardKey(0, 0), ShardKey(3, 0), ShardKey(2, 1), ShardKey(9, 9)],  # (9, 9): held by nobody
}
BROKEN = ShardKey(4, 0)
MANY = ShardKey(5, 0)


def make_state(key: ShardKey) -> ShardState:
    """One shard's parameters and optimizer state, the same bytes in every process."""
    g = torch.Generator().manual_seed(100 * key.layer + key.tp_rank)
    weight = torch.randn(48, 80, generator=g, requires_grad=True)  # a live parameter
    many = {f"exp_avg/many.{i}": torch.randn(i % 5, generator=g) for i in range(700)} if key == MANY else {}
    return many | {
        "param/weight": weight.t(),  # (80, 48), non-contiguous: sent as one contiguous copy
        "param/bias": torch.randn(80, generator=g).to(torch.bfloat16),
        "param/odd": torch.randn(3, generator=g).to(torch.bfloat16),  # 6 bytes: not a whole word
        "exp_avg/weight": torch.randn(80, 48, generator=g),
        "exp_avg_sq/weight": torch.rand(80, 48, generator=g),
        "exp_avg/empty": torch.empty(0, 4),
        "step": torch.tensor(10 + key.layer, dtype=torch.int64),
    }


def state_bytes(state: ShardState) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def shuffled(d: dict[Any, list[Any]], seed: int) -> dict[Any, list[Any]]:
    """The same mapping with its keys and lists in another order."""
    rng = random.Random(seed)
    items = [(k, rng.sample(v, len(v))) for k, v in d.items()]
    rng.shuffle(items)
    return dict(items)


def make_group(store_port: int, rank: int, size: int) -> Communicator:
    """A gloo communicator, as the runtime makes one (`elastic.comm.open_communicator`)."""
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=TIMEOUT)
    return open_communicator(store, name="g1/world", members=list(range(size)), rank=rank, backend="gloo",
                             device=torch.device("cpu"), timeout=TIMEOUT)


def plain_wait(work: Handle) -> None:
    work.wait()


# ---- three processes --------------------------------------------------------------------------


def exchange_worker(rank: int, store_port: int, out: str) -> None:
    torch.set_num_threads(1)
    group = make_group(store_port, rank, 3)
    moves = assign_moves(shuffled(NEEDS, rank), shuffled(HOLDERS, rank))  # every rank: another order
    exported: list[ShardKey] = []

    def export(key: ShardKey) -> ShardState:
        exported.append(key)
        if key == BROKEN:
            raise KeyError(f"shard {tuple(key)} is not held here")
        return make_state(key)

    result = exchange(group, rank=rank, moves=moves, export=export, wait=plain_wait)
    torch.save({"moves": moves, "result": result, "exported": exported}, f"{out}.{rank}")
    group.all_reduce(torch.zeros(1)).wait()  # nobody leaves while a peer may still read from it


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_exchange_three_processes_bit_identical(tmp_path: Path) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    out = str(tmp_path / "result")
    ctx = mp.get_context("spawn")
    procs: list[BaseProcess] = [
        ctx.Process(target=exchange_worker, args=(r, store.port, out), daemon=True) for r in range(3)
    ]
    run_processes(procs, timeout=100)
    runs = [torch.load(f"{out}.{r}", weights_only=False) for r in range(3)]

    moves = assign_moves(NEEDS, HOLDERS)
    assert all(run["moves"] == moves for run in runs)  # the same moves whatever the dict order
    assert {(m.src, m.dst) for m in moves} == {(0, 1), (1, 0), (0, 2), (1, 2)}
    assert len(encode_header([describe_shard(MANY, make_state(MANY))])) > HEADER_FRAME_BYTES
    sent = {r: sorted({m.key for m in moves if m.src == r}) for r in range(3)}
    for rank, run in enumerate(runs):
        assert sorted(run["exported"]) == sent[rank]  # once per shard, however many receivers
        result = run["result"]
        mine = {m.key for m in moves if m.dst == rank}
        want = mine - {BROKEN}
        assert set(result.shards) == want, rank
        for key in want:
            got, ref = result.shards[key], make_state(key)
            assert got.keys() == ref.keys(), (rank, key)
            for name in ref:
                assert bit_equal(got[name], ref[name]), (rank, key, name)
                assert got[name].is_contiguous() and got[name].device.type == "cpu"
        assert set(result.failed) == mine & {BROKEN}
        if BROKEN in mine:
            assert "could not export" in result.failed[BROKEN] and "not held here" in result.failed[BROKEN]
        assert result.bytes_received == sum(state_bytes(make_state(k)) for k in want)
        sent_bytes = sum(state_bytes(make_state(m.key)) for m in moves if m.src == rank and m.key != BROKEN)
        assert result.bytes_sent == sent_bytes
        assert result.seconds > 0
    assert ShardKey(9, 9) not in runs[2]["result"].failed  # unheld: left to the caller, not attempted


# ---- a shard that changed after its header was sent -------------------------------------------


def corrupt_worker(rank: int, store_port: int, out: str) -> None:
    """Rank 0 sends two shards to rank 1 and changes one tensor of the second after posting."""
    torch.set_num_threads(1)
    group = make_group(store_port, rank, 2)
    intact, changed = ShardKey(0, 0), ShardKey(1, 0)
    moves = [ShardMove(key=intact, src=0, dst=1), ShardMove(key=changed, src=0, dst=1)]
    states = {key: make_state(key) for key in (intact, changed)}
    hits: list[int] = []

    def wait(work: Handle) -> None:
        if rank == 0 and not hits:  # the header (with the checksums) is posted; the data is not sent
            states[changed]["exp_avg_sq/weight"][5, 5] += 1.0  # until rank 1 asks for it, after 0.5 s
        if rank == 1 and not hits:
            time.sleep(0.5)
        hits.append(1)
        work.wait()

    result = exchange(group, rank=rank, moves=moves, export=states.__getitem__, wait=wait)
    torch.save(result, f"{out}.{rank}")
    group.all_reduce(torch.zeros(1)).wait()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_exchange_reports_a_corrupt_shard_and_keeps_the_others(tmp_path: Path) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    out = str(tmp_path / "result")
    ctx = mp.get_context("spawn")
    procs: list[BaseProcess] = [
        ctx.Process(target=corrupt_worker, args=(r, store.port, out), daemon=True) for r in range(2)
    ]
    run_processes(procs, timeout=100)
    result = torch.load(f"{out}.1", weights_only=False)
    assert list(result.failed) == [ShardKey(1, 0)]
    assert "exp_avg_sq/weight: checksum" in result.failed[ShardKey(1, 0)]
    ref = make_state(ShardKey(0, 0))
    assert all(bit_equal(result.shards[ShardKey(0, 0)][n], ref[n]) for n in ref)
    assert result.bytes_received == 2 * state_bytes(ref)  # the corrupt shard arrived too


# ---- errors of the group propagate ------------------------------------------------------------


def failing_worker(rank: int, store_port: int, scenario: str, out: str) -> None:
    """Rank 0 sends one shard to rank 1; `scenario` breaks the exchange; rank 1 reports what it raised."""
    torch.set_num_threads(1)
    group = make_group(store_port, rank, 2)
    # Both ranks finish connecting before anything breaks: without this, rank 0 could die while rank 1
    # (on a busy core) is still in gloo's connectFullMesh, which is the group's creation failing, not the exchange.
    group.all_reduce(torch.zeros(1)).wait()
    key = ShardKey(0, 0)
    moves = [ShardMove(key=key, src=0, dst=1)]
    abort = AbortSignal()
    if scenario == "abort" and rank == 1:
        abort.set("a peer stopped answering (test)")

    def export(k: ShardKey) -> ShardState:
        if scenario == "peer_died":
            os._exit(0)  # the sender dies before it sent anything
        return make_state(k)

    began = time.monotonic()
    try:
        exchange(group, rank=rank, moves=moves, export=export, wait=lambda work: wait_work(work, abort))
        outcome = "returned"
    except Exception as exc:  # the test checks which type came out
        outcome = f"{type(exc).__name__}: {exc}"
    Path(f"{out}.{rank}.seconds").write_text(f"{time.monotonic() - began:.3f}")
    Path(f"{out}.{rank}").write_text(outcome)
    os._exit(0)  # leave pending sends behind without waiting for the group's teardown


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("scenario", ["abort", "peer_died"])
def test_exchange_errors_propagate(tmp_path: Path, scenario: str) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    out = str(tmp_path / "outcome")
    ctx = mp.get_context("spawn")
    procs: list[BaseProcess] = [
        ctx.Process(target=failing_worker, args=(r, store.port, scenario, out), daemon=True) for r in range(2)
    ]
    run_processes(procs, timeout=100)
    outcome = Path(f"{out}.1").read_text()
    if scenario == "abort":
        assert outcome == f"{StepAborted.__name__}: step aborted: a peer stopped answering (test)"
        # The sender's pending sends fail when the aborted receiver goes: gloo's error, unchanged.
        assert Path(f"{out}.0").read_text().startswith("RuntimeError")
    else:
        assert outcome.startswith("RuntimeError"), outcome  # gloo's own error, unchanged
        seconds = float(Path(f"{out}.1.seconds").read_text())
        assert seconds < TIMEOUT.total_seconds() / 2, seconds  # seen when the peer went, not timed out


# ---- checksum and verification ----------------------------------------------------------------


def test_checksum_detects_flips_swaps_dtype_and_shape() -> None:
    g = torch.Generator().manual_seed(0)
    words_per_chunk = CHECKSUM_CHUNK_WORDS * 2  # int32 words
    t = torch.randn(3 * words_per_chunk, generator=g)  # 3 checksum chunks
    base = tensor_checksum(t)
    assert tensor_checksum(t.clone()) == base

    flipped = t.clone()
    flipped.view(torch.int32)[12345] ^= 1 << 7  # one bit of one word
    assert tensor_checksum(flipped) != base

    swapped = t.clone().view(3, words_per_chunk)
    swapped[[0, 2]] = swapped[[2, 0]]  # chunks 0 and 2 trade places: the plain sum is unchanged
    assert tensor_checksum(swapped.reshape(-1)) != base

    assert tensor_checksum(t.view(torch.int32)) != base  # same bytes, another dtype
    assert tensor_checksum(t.view(3, -1)) != base  # same bytes, another shape
    assert tensor_checksum(t.view(1, -1)) != tensor_checksum(t.view(-1, 1))


def test_checksum_of_odd_sizes_views_and_scalars() -> None:
    raw = torch.arange(13, dtype=torch.uint8)  # 13 bytes: one word and a 5-byte tail
    tail = raw.clone()
    tail[12] += 1  # the last byte, in the padded tail word
    assert tensor_checksum(tail) != tensor_checksum(raw)
    assert tensor_checksum(torch.tensor(5)) != tensor_checksum(torch.tensor(6))  # 0-d int64
    assert tensor_checksum(torch.tensor(5)) != tensor_checksum(torch.tensor([5]))  # 0-d vs 1-d
    bf16 = torch.randn(101).to(torch.bfloat16)
    assert tensor_checksum(bf16[3:60]) == tensor_checksum(bf16[3:60].clone())  # a view at an odd offset
    w = torch.randn(40, 24)
    assert tensor_checksum(w.t()) == tensor_checksum(w.t().contiguous())  # checksums the logical bytes
    assert tensor_checksum(torch.empty(0, 4)) != tensor_checksum(torch.empty(4, 0))


@pytest.mark.parametrize("words", [0, 5, CHECKSUM_CHUNK_WORDS, 3 * CHECKSUM_CHUNK_WORDS + 17])
def test_checksum_is_the_same_on_every_device(words: int) -> None:
    """The numpy reduction (CPU) and the torch one (any other device) agree modulo 2^64, so a
    GPU sender and a CPU receiver (or the reverse) compute the same checksum. Both run on CPU
    here, on words that overflow int64 when summed."""
    x = torch.randint(-(2**63), 2**63 - 1, (words,), dtype=torch.int64, generator=torch.Generator().manual_seed(1))
    full = words // CHECKSUM_CHUNK_WORDS
    mask = (1 << 64) - 1
    by_numpy = [v & mask for v in shard_header._chunk_sums_numpy(x, full)]
    assert by_numpy == [v & mask for v in shard_header._chunk_sums_torch(x, full)]


def test_verify_shard_rejects_a_tampered_header() -> None:
    key = ShardKey(5, 1)
    state = make_state(key)
    metas = describe_shard(key, state).tensors
    assert verify_shard(metas, state) is None
    assert verify_shard(metas, {n: t.contiguous().clone() for n, t in state.items()}) is None

    def tampered(name: str, **change: Any) -> list[Any]:
        return [dataclasses.replace(m, **change) if m.name == name else m for m in metas]

    cases = {
        "checksum": tampered("exp_avg/weight", checksum="0" * 40),
        "shape": tampered("param/weight", shape=(48, 80)),
        "dtype": tampered("param/bias", dtype="float16"),
        "missing": [*metas, dataclasses.replace(metas[0], name="exp_avg_sq/bias")],
        "extra": [m for m in metas if m.name != "step"],
        "twice": [*metas, metas[-1]],
    }
    for case, header in cases.items():
        reason = verify_shard(header, state)
        assert reason is not None, case
    assert "exp_avg/weight: checksum" in str(verify_shard(cases["checksum"], state))
    assert "did not arrive" in str(verify_shard(cases["missing"], state))
    assert "unexpected" in str(verify_shard(cases["extra"], state))

    corrupt = dict(state)
    corrupt["exp_avg_sq/weight"] = state["exp_avg_sq/weight"].clone()
    corrupt["exp_avg_sq/weight"][3, 7] += 1.0  # the data, not the header, changed
    assert "exp_avg_sq/weight: checksum" in str(verify_shard(metas, corrupt))


def test_header_round_trip_and_garbage() -> None:
    key = ShardKey(2, 3)
    shards = [describe_shard(key, make_state(key)), ShardHeader(key=ShardKey(7, 0), tensors=(), error="gone")]
    assert decode_header(encode_header(shards)) == shards
    garbage = [b"\xff\xfe", b"{}", b'{"version": 99, "shards": []}', b'{"version": 1, "shards": [{"key": [1]}]}']
    for raw in garbage:
        with pytest.raises(ProtocolError):
            decode_header(raw)


# ---- validation on a group of one --------------------------------------------------------------


def test_exchange_validates_moves() -> None:
    group = open_communicator(dist.HashStore(), name="g1/world", members=[0], rank=0, backend="gloo",
                              device=torch.device("cpu"), timeout=TIMEOUT)
    wait = plain_wait
    key = ShardKey(0, 0)
    empty = exchange(group, rank=0, moves=[], export=make_state, wait=wait)
    assert empty.shards == {} and empty.failed == {} and empty.bytes_sent == empty.bytes_received == 0
    with pytest.raises(ValueError, match="itself"):
        exchange(group, rank=0, moves=[ShardMove(key=key, src=0, dst=0)], export=make_state, wait=wait)
    with pytest.raises(ValueError, match="not my rank"):
        exchange(group, rank=1, moves=[], export=make_state, wait=wait)
    with pytest.raises(ValueError, match="must lie in"):
        exchange(group, rank=0, moves=[ShardMove(key=key, src=0, dst=4)], export=make_state, wait=wait)


# ---- the assignment -----------------------------------------------------------------------------


def test_assignment_is_deterministic_under_reordering() -> None:
    holders = {ShardKey(layer, tp): [(layer + tp) % 4, (layer + 2 * tp + 1) % 4] for layer in range(6) for tp in (0, 1)}
    needs = {dst: [k for k in holders if dst not in holders[k]][: 5 + dst] for dst in range(4)}
    moves = assign_moves(needs, holders)
    assert moves and all(assign_moves(shuffled(needs, s), shuffled(holders, s)) == moves for s in range(10))
    # plain tuples are the same keys as ShardKeys
    assert assign_moves({d: [tuple(k) for k in ks] for d, ks in needs.items()}, holders) == moves  # type: ignore[misc]
    assert moves == sorted(moves, key=lambda m: (m.src, m.dst, m.key))


def test_assignment_balances_and_never_sends_to_itself() -> None:
    keys = [ShardKey(layer, 0) for layer in range(6)]
    moves = assign_moves({3: keys}, {k: [0, 1, 2] for k in keys})
    loads = [sum(m.src == r for m in moves) for r in range(3)]
    assert loads == [2, 2, 2] and {m.dst for m in moves} == {3}

    # Fewest candidates first: B (only on 0) is placed before A, which then goes to the idle 1.
    a, b = ShardKey(0, 0), ShardKey(1, 0)
    assert assign_moves({2: [a, b]}, {a: [0, 1], b: [0]}) == [
        ShardMove(key=b, src=0, dst=2),
        ShardMove(key=a, src=1, dst=2),
    ]
    # Ties go to the lowest rank.
    assert assign_moves({2: [a]}, {a: [1, 0]}) == [ShardMove(key=a, src=0, dst=2)]

    # A receiver that holds a copy itself is never its own sender; unheld shards are skipped.
    c, lost = ShardKey(2, 0), ShardKey(9, 9)
    moves = assign_moves({0: [c, lost], 1: [c]}, {c: [0, 1], lost: []})
    assert moves == [ShardMove(key=c, src=0, dst=1), ShardMove(key=c, src=1, dst=0)]
    assert assign_moves({0: [c]}, {c: [0]}) == []
