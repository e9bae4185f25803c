"""Fixtures of the transfer suite: real gRPC shard servers on 127.0.0.1, stopped at teardown."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import grpc
import pytest
import torch

from elastic.transfer.server import ServerConfig, ShardServer
from elastic.transfer.shards import ShardKey
from tests.transfer.shard_data import make_shard

TOKEN = "test-job-token"

Shards = dict[ShardKey, dict[str, torch.Tensor]]
ServeFn = Callable[..., ShardServer]


def shard_set(keys: Sequence[tuple[int, int]], *, numel: int = 4096) -> Shards:
    return {ShardKey(*k): make_shard(*k, numel=numel) for k in keys}


@pytest.fixture
def serve() -> Iterator[ServeFn]:
    """`serve(shards, generation=0, interceptors=(), **config)` starts a server on a free port."""
    servers: list[ShardServer] = []

    def start(
        shards: Shards,
        *,
        generation: int = 0,
        interceptors: Sequence[grpc.ServerInterceptor] = (),
        **config: object,
    ) -> ShardServer:
        server = ShardServer(
            ServerConfig(token=TOKEN, **config),  # type: ignore[arg-type]
            provider=lambda layer, tp: shards[ShardKey(layer, tp)],
            generation=generation,
            interceptors=interceptors,
        )
        servers.append(server.start())
        return server

    yield start
    for server in servers:
        server.stop()
