"""Fetching shards from real gRPC servers on 127.0.0.1: exact bytes, spreading, checksums, refusals."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from elastic.transfer import shard_transfer_pb2 as pb
from elastic.transfer import shard_transfer_pb2_grpc as pb_grpc
from elastic.transfer.client import FetchConfig, TransferError, fetch_shards
from elastic.transfer.shards import ShardKey
from elastic.transfer.wire import SERVICE
from tests.transfer.conftest import TOKEN, ServeFn, shard_set
from tests.transfer.faults import CorruptChunks, FetchReplyInterceptor, RecordChunks
from tests.transfer.shard_data import bit_equal, shards_equal

pytestmark = pytest.mark.timeout(60)

KEYS = [(layer, tp) for layer in range(3) for tp in range(2)]


def config(**overrides: object) -> FetchConfig:
    return FetchConfig(**{"token": TOKEN, "generation": 0, **overrides})  # type: ignore[arg-type]


def test_round_trip_is_bit_exact_for_dtypes_and_shapes(serve: ServeFn) -> None:
    odd = {
        "fp32_nc": torch.randn(7, 5).t(),
        "fp32_strided": torch.randn(40)[::3],
        "bf16": torch.randn(3, 4, 5).to(torch.bfloat16).permute(2, 0, 1),
        "int64": torch.arange(-50, 50, dtype=torch.int64).reshape(4, 25),
        "scalar_i64": torch.tensor(123456789012, dtype=torch.int64),
        "empty_bf16": torch.empty(0, dtype=torch.bfloat16),
        "empty_2d": torch.empty(5, 0),
        "nan_inf": torch.tensor([float("nan"), float("inf"), -0.0]),
        "fp16": torch.randn(33).half(),
        "bool": torch.tensor([True, False, True]),
    }
    shards = {ShardKey(0, 0): odd, **shard_set([(1, 0)])}
    server = serve(shards, chunk_bytes=7)  # tiny chunks: tensors straddle chunk boundaries
    result = fetch_shards(shards, {server.address: shards}, config())
    assert result.shards.keys() == shards.keys()
    for key, tensors in shards.items():
        assert shards_equal(result.shards[key], tensors), key
    assert result.refetches == 0 and result.incidents == {}
    assert result.bytes_moved == sum(t.numel() * t.element_size() for s in shards.values() for t in s.values())


def test_large_tensor_travels_in_many_chunks(serve: ServeFn) -> None:
    big = {ShardKey(5, 1): {"w": torch.randn(1 << 21)}}  # 8 MiB
    recorder = RecordChunks()
    server = serve(big, chunk_bytes=256 << 10, interceptors=[FetchReplyInterceptor(recorder)])
    result = fetch_shards(big, {server.address: big}, config())
    assert bit_equal(result.shards[(5, 1)]["w"], big[ShardKey(5, 1)]["w"])
    assert recorder.sizes == [256 << 10] * 32


def test_client_asks_for_chunks_that_fit_its_limit(serve: ServeFn) -> None:
    big = {ShardKey(0, 0): {"w": torch.randn(1 << 18)}}  # 1 MiB
    recorder = RecordChunks()
    server = serve(big, interceptors=[FetchReplyInterceptor(recorder)])  # server default: 4 MiB chunks
    limit = 128 << 10
    result = fetch_shards(big, {server.address: big}, config(max_reply_bytes=limit))
    assert bit_equal(result.shards[(0, 0)]["w"], big[ShardKey(0, 0)]["w"])
    assert max(recorder.sizes) < limit and len(recorder.sizes) > 1


def test_shards_are_spread_across_holders(serve: ServeFn) -> None:
    shards = shard_set(KEYS)
    a, b = serve(shards), serve(shards)
    result = fetch_shards(KEYS, {a.address: KEYS, b.address: KEYS}, config())
    for key in KEYS:
        assert shards_equal(result.shards[ShardKey(*key)], shards[ShardKey(*key)])
    per_shard = result.bytes_moved // len(KEYS)
    assert result.bytes_by_holder == {a.address: 3 * per_shard, b.address: 3 * per_shard}


def test_corrupted_chunk_is_rejected_and_fetched_from_another_holder(serve: ServeFn) -> None:
    shards = shard_set(KEYS)
    corrupt = CorruptChunks(times=1)
    a = serve(shards, interceptors=[FetchReplyInterceptor(corrupt)])
    b = serve(shards)
    result = fetch_shards(KEYS, {a.address: KEYS, b.address: KEYS}, config())
    assert corrupt.corrupted == 1
    for key in KEYS:
        assert shards_equal(result.shards[ShardKey(*key)], shards[ShardKey(*key)])
    assert result.refetches == 1
    [(bad_key, reasons)] = result.incidents.items()
    assert len(reasons) == 1 and reasons[0].startswith(a.address) and "checksum mismatch" in reasons[0]
    # The bad shard came again from b: a sent 3 shards, b its 3 plus the re-fetch.
    per_shard = result.bytes_moved // (len(KEYS) + 1)
    assert result.bytes_by_holder == {a.address: 3 * per_shard, b.address: 4 * per_shard}


def test_corrupted_chunk_is_fetched_again_from_a_lone_holder(serve: ServeFn) -> None:
    shards = shard_set(KEYS[:2])
    corrupt = CorruptChunks(times=1)
    a = serve(shards, interceptors=[FetchReplyInterceptor(corrupt)])
    result = fetch_shards(shards, {a.address: shards}, config())
    assert corrupt.corrupted == 1 and result.refetches == 1
    for key, tensors in shards.items():
        assert shards_equal(result.shards[key], tensors)


def test_persistent_corruption_gives_up_after_bounded_attempts(serve: ServeFn) -> None:
    shards = shard_set([(0, 0)])
    corrupt = CorruptChunks(times=1000)
    a = serve(shards, interceptors=[FetchReplyInterceptor(corrupt)])
    with pytest.raises(TransferError, match=r"shard \(0, 0\) failed 3 times: .*checksum mismatch") as info:
        fetch_shards(shards, {a.address: shards}, config(max_attempts=3))
    assert corrupt.corrupted == 3 * 4  # three tries, four non-empty tensors each
    assert len(info.value.failures[ShardKey(0, 0)]) == 3


def test_wrong_token_is_refused_and_server_keeps_serving(serve: ServeFn) -> None:
    shards = shard_set(KEYS[:2])
    a = serve(shards)
    with pytest.raises(TransferError, match="UNAUTHENTICATED: wrong or missing job token"):
        fetch_shards(shards, {a.address: shards}, config(token="not-the-token"))
    result = fetch_shards(shards, {a.address: shards}, config())
    for key, tensors in shards.items():
        assert shards_equal(result.shards[key], tensors)


def test_unknown_shard_is_not_found(serve: ServeFn) -> None:
    a = serve(shard_set([(0, 0)]))
    with pytest.raises(TransferError, match=r"does not hold shard\(s\) \(layer=9, tp_rank=1\)"):
        fetch_shards([(9, 1)], {a.address: [(9, 1)]}, config())


def test_holder_missing_a_listed_shard_is_bypassed_without_penalising_the_rest(serve: ServeFn) -> None:
    full = shard_set(KEYS[:4])
    partial = {k: v for k, v in full.items() if k != ShardKey(0, 0)}
    a, b = serve(partial), serve(full)
    # a is wrongly listed as holding every shard
    result = fetch_shards(full, {a.address: full, b.address: full}, config(max_attempts=2))
    for key, tensors in full.items():
        assert shards_equal(result.shards[key], tensors)
    assert list(result.incidents) == [ShardKey(0, 0)]
    assert "NOT_FOUND" in result.incidents[ShardKey(0, 0)][0]


def test_stale_generation_is_refused_and_newer_waits_for_the_holder(serve: ServeFn) -> None:
    shards = shard_set([(0, 0)])
    a = serve(shards, generation=3)
    with pytest.raises(TransferError, match="FAILED_PRECONDITION: stale generation: .* generation 2, .* generation 3"):
        fetch_shards(shards, {a.address: shards}, config(generation=2))
    # A newer requester is told "not yet" (retryable) until the holder resolves its step and moves on.
    with pytest.raises(TransferError, match="did not reach generation 4 within 0 s: UNAVAILABLE"):
        fetch_shards(shards, {a.address: shards}, config(generation=4, behind_wait_s=0.0))
    timer = threading.Timer(0.5, a.set_generation, args=(4,))
    timer.start()
    try:
        t0 = time.monotonic()
        result = fetch_shards(shards, {a.address: shards}, config(generation=4, behind_wait_s=30.0))
        waited = time.monotonic() - t0
    finally:
        timer.join()
    assert shards_equal(result.shards[ShardKey(0, 0)], shards[ShardKey(0, 0)])
    assert waited >= 0.45 and result.refetches == 0 and not result.incidents  # retries are not failures
    a.set_generation(5)
    with pytest.raises(TransferError, match="stale generation"):
        fetch_shards(shards, {a.address: shards}, config(generation=4))
    with pytest.raises(ValueError, match="generation may only grow"):
        a.set_generation(4)


def test_a_holder_that_stays_behind_is_dropped_for_one_that_is_not(serve: ServeFn) -> None:
    shards = shard_set(KEYS[:4])
    behind, current = serve(shards, generation=3), serve(shards, generation=4)
    t0 = time.monotonic()
    result = fetch_shards(shards, {behind.address: shards, current.address: shards},
                          config(generation=4, behind_wait_s=0.3))
    assert time.monotonic() - t0 >= 0.3  # it was asked again until the wait ran out
    for key, tensors in shards.items():
        assert shards_equal(result.shards[key], tensors)
    assert result.bytes_by_holder.get(behind.address, 0) == 0
    assert result.incidents and all(
        reasons == [f"{behind.address}: did not reach generation 4 within 0 s: UNAVAILABLE: generation 4 not "
                    "reached yet: this server is at generation 3 until its in-flight step is resolved; retry"]
        for reasons in result.incidents.values()
    ), result.incidents


def test_the_server_has_no_list_method(serve: ServeFn) -> None:
    """Who holds which shard is read from etcd (elastic.roles.holders), never asked of a server."""
    a = serve(shard_set(KEYS[:1]))
    channel = grpc.insecure_channel(a.address)
    try:
        with pytest.raises(grpc.RpcError) as info:
            channel.unary_unary(f"/{SERVICE}/List")(b"", timeout=10)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        channel.close()
    assert not hasattr(pb_grpc.ShardTransferServicer, "List") and not hasattr(pb, "ListRequest")


def test_oversized_request_is_rejected_and_server_keeps_serving(serve: ServeFn) -> None:
    shards = shard_set([(0, 0)])
    a = serve(shards, max_request_bytes=1024)
    many = [(layer, 0) for layer in range(400)]  # about 3 KiB of shard ids
    with pytest.raises(TransferError, match="RESOURCE_EXHAUSTED"):
        fetch_shards(many, {a.address: many}, config())
    assert shards_equal(fetch_shards(shards, {a.address: shards}, config()).shards[ShardKey(0, 0)], shards[ShardKey(0, 0)])


def test_oversized_reply_is_rejected_by_the_client_channel(serve: ServeFn) -> None:
    shards = {ShardKey(0, 0): {"w": torch.randn(1 << 18)}}  # one 1 MiB chunk at the server default
    a = serve(shards)
    channel = grpc.insecure_channel(a.address, options=[("grpc.max_receive_message_length", 64 << 10)])
    try:
        request = pb.FetchRequest(
            credentials=pb.Credentials(token=TOKEN, generation=0), shards=[pb.ShardId(layer=0, tp_rank=0)]
        )
        with pytest.raises(grpc.RpcError) as info:
            list(pb_grpc.ShardTransferStub(channel).Fetch(request, timeout=20))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        channel.close()


def test_a_plain_generated_stub_reads_the_stream(serve: ServeFn) -> None:
    """The server's hand-framed data chunks are ordinary protobuf to any client."""
    shards = {ShardKey(2, 1): {"w": torch.randn(3000), "b": torch.arange(5)}}
    a = serve(shards, chunk_bytes=1000)
    channel = grpc.insecure_channel(a.address)
    try:
        request = pb.FetchRequest(
            credentials=pb.Credentials(token=TOKEN, generation=0), shards=[pb.ShardId(layer=2, tp_rank=1)]
        )
        replies = list(pb_grpc.ShardTransferStub(channel).Fetch(request, timeout=20))
    finally:
        channel.close()
    kinds = [r.WhichOneof("item") for r in replies]
    assert kinds == ["shard_start", "tensor_start"] + ["data"] * 12 + ["tensor_end", "tensor_start", "data", "tensor_end", "shard_end"]
    raw = b"".join(r.data for r in replies[2:14])
    assert raw == shards[ShardKey(2, 1)]["w"].numpy().tobytes()


def test_no_listed_holder_is_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"no holder is listed for shards \[\(2, 0\)\]"):
        fetch_shards([(2, 0)], {"127.0.0.1:1": [(1, 0)]}, config())


def test_unreachable_holder_is_dropped_for_a_live_one(serve: ServeFn) -> None:
    shards = shard_set(KEYS[:2])
    a = serve(shards)
    dead = serve(shards)
    dead_address = dead.address
    dead.stop()
    result = fetch_shards(shards, {dead_address: shards, a.address: shards}, config())
    for key, tensors in shards.items():
        assert shards_equal(result.shards[key], tensors)
    assert result.bytes_by_holder.get(dead_address, 0) == 0
    [reasons] = result.incidents.values()
    assert len(reasons) == 1 and reasons[0].startswith(f"{dead_address}: UNAVAILABLE")
