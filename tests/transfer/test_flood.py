"""A shard server under a flood of requests from a client with a valid token: at most
`max_concurrent_streams` streams are served at once, extra ones are refused as busy (and a real
fetch retries them), requests naming too many shards are refused, and the server keeps serving."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping

import grpc
import pytest
import torch

from elastic.transfer import shard_transfer_pb2 as pb
from elastic.transfer import shard_transfer_pb2_grpc as pb_grpc
from elastic.transfer.client import FetchConfig, fetch_shards
from elastic.transfer.server import SERVER_BUSY_KEY, ServerConfig, ShardServer
from elastic.transfer.shards import ShardKey
from tests.transfer.conftest import TOKEN, shard_set
from tests.transfer.shard_data import shards_equal

pytestmark = pytest.mark.timeout(60)


class GatedProvider:
    """Serves `shards`; a request for `gated` blocks until `open` is set (a stream held open)."""

    def __init__(self, shards: Mapping[ShardKey, dict[str, torch.Tensor]], gated: ShardKey) -> None:
        self.shards, self.gated = shards, gated
        self.open = threading.Event()
        self.entered = threading.Event()

    def __call__(self, layer: int, tp: int) -> dict[str, torch.Tensor]:
        key = ShardKey(layer, tp)
        if key == self.gated:
            self.entered.set()
            assert self.open.wait(30)
        return self.shards[key]


@pytest.fixture
def gated() -> Iterator[tuple[ShardServer, GatedProvider]]:
    shards = shard_set([(0, 0), (1, 0)])
    provider = GatedProvider(shards, ShardKey(0, 0))
    server = ShardServer(ServerConfig(token=TOKEN, max_concurrent_streams=1, busy_wait_s=0.05),
                         provider=provider).start()
    yield server, provider
    provider.open.set()
    server.stop()


def raw_fetch(address: str, keys: list[tuple[int, int]]) -> list[pb.FetchReply]:
    channel = grpc.insecure_channel(address)
    try:
        request = pb.FetchRequest(credentials=pb.Credentials(token=TOKEN, generation=0),
                                  shards=[pb.ShardId(layer=layer, tp_rank=t) for layer, t in keys])
        return list(pb_grpc.ShardTransferStub(channel).Fetch(request, timeout=20))
    finally:
        channel.close()


def test_a_stream_beyond_the_limit_is_refused_busy_and_a_fetch_retries_until_served(
    gated: tuple[ShardServer, GatedProvider],
) -> None:
    server, provider = gated
    holder = threading.Thread(target=raw_fetch, args=(server.address, [(0, 0)]), daemon=True)
    holder.start()  # takes the one stream slot and keeps it until the gate opens
    assert provider.entered.wait(10)
    with pytest.raises(grpc.RpcError) as info:
        raw_fetch(server.address, [(1, 0)])
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(info.value.trailing_metadata() or ())[SERVER_BUSY_KEY] == "1"
    refused = server.busy_refusals
    assert refused >= 1
    # A real fetch meanwhile is refused busy too, retries, and succeeds once the slot frees.
    timer = threading.Timer(0.5, provider.open.set)
    timer.start()
    result = fetch_shards([ShardKey(1, 0)], {server.address: [ShardKey(1, 0)]},
                          FetchConfig(token=TOKEN, generation=0, behind_wait_s=20))
    timer.join()
    holder.join(10)
    assert server.busy_refusals > refused, "the fetch never met a busy server"
    assert result.refetches == 0 and not result.incidents
    assert shards_equal(result.shards[ShardKey(1, 0)], provider.shards[ShardKey(1, 0)])


def test_a_fetch_gives_up_on_a_server_busy_for_longer_than_behind_wait(
    gated: tuple[ShardServer, GatedProvider],
) -> None:
    from elastic.transfer.client import TransferError

    server, provider = gated
    holder = threading.Thread(target=raw_fetch, args=(server.address, [(0, 0)]), daemon=True)
    holder.start()
    assert provider.entered.wait(10)
    with pytest.raises(TransferError, match="stayed busy within 1 s"):
        fetch_shards([ShardKey(1, 0)], {server.address: [ShardKey(1, 0)]},
                     FetchConfig(token=TOKEN, generation=0, behind_wait_s=1, max_attempts=1))
    provider.open.set()
    holder.join(10)


def test_a_request_naming_too_many_shards_is_refused_and_the_server_keeps_serving() -> None:
    shards = shard_set([(0, 0)])
    with ShardServer(ServerConfig(token=TOKEN, max_shards_per_request=8),
                     provider=lambda layer, tp: shards[ShardKey(layer, tp)]) as server:
        with pytest.raises(grpc.RpcError) as info:
            raw_fetch(server.address, [(layer, 0) for layer in range(9)])
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "more than the 8 one request may name" in (info.value.details() or "")
        assert server.streams.acquire(timeout=1)  # the refusal did not keep a stream slot
        server.streams.release()
        result = fetch_shards([ShardKey(0, 0)], {server.address: [ShardKey(0, 0)]},
                              FetchConfig(token=TOKEN, generation=0))
        assert shards_equal(result.shards[ShardKey(0, 0)], shards[ShardKey(0, 0)])


def test_many_concurrent_streams_never_run_more_than_the_limit_at_once() -> None:
    shards = shard_set([(0, 0)], numel=1 << 16)
    running, peak, lock = 0, 0, threading.Lock()

    def provider(layer: int, tp: int) -> dict[str, torch.Tensor]:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        try:
            threading.Event().wait(0.02)
            return shards[ShardKey(layer, tp)]
        finally:
            with lock:
                running -= 1

    config = ServerConfig(token=TOKEN, max_concurrent_streams=2, busy_wait_s=5.0, max_workers=16)
    with ShardServer(config, provider=provider) as server:
        outcomes: list[str] = []

        def one() -> None:
            try:
                raw_fetch(server.address, [(0, 0)])
                outcomes.append("ok")
            except grpc.RpcError as e:
                outcomes.append(e.code().name)

        threads = [threading.Thread(target=one) for _ in range(24)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert peak <= 2, peak
    assert len(outcomes) == 24 and set(outcomes) <= {"ok", "RESOURCE_EXHAUSTED"}, outcomes
    assert outcomes.count("ok") >= 2
