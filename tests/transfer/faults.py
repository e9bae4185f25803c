"""Server interceptors that tamper with the real reply stream of Fetch (test-only fault hooks)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from elastic.transfer import shard_transfer_pb2 as pb
from elastic.transfer.wire import DataChunk, FetchItem

ReplyHook = Callable[[FetchItem], FetchItem]


def chunk_bytes(item: FetchItem) -> bytes | None:
    """The payload of a data reply (either form the server may yield), None for other replies."""
    if isinstance(item, DataChunk):
        return item.view.tobytes()
    return item.data if item.WhichOneof("item") == "data" else None


class FetchReplyInterceptor(grpc.ServerInterceptor):
    """Passes every Fetch reply through `hook` before it is serialized and sent."""

    def __init__(self, hook: ReplyHook) -> None:
        self._hook = hook

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None or not details.method.endswith("/Fetch"):
            return handler
        inner = handler.unary_stream

        def stream(request: pb.FetchRequest, context: grpc.ServicerContext) -> Iterator[FetchItem]:
            for reply in inner(request, context):
                yield self._hook(reply)

        return grpc.unary_stream_rpc_method_handler(
            stream,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


class CorruptChunks:
    """Flips one byte in the first `times` non-empty data chunks the server sends."""

    def __init__(self, times: int = 1) -> None:
        self.remaining = times
        self.corrupted = 0
        self._lock = threading.Lock()

    def __call__(self, reply: FetchItem) -> FetchItem:
        payload = chunk_bytes(reply)
        if not payload:
            return reply
        with self._lock:
            if self.remaining == 0:
                return reply
            self.remaining -= 1
            self.corrupted += 1
        data = bytearray(payload)
        data[len(data) // 2] ^= 0x40
        return pb.FetchReply(data=bytes(data))


class RecordChunks:
    """Records the size of every data chunk sent."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def __call__(self, reply: FetchItem) -> FetchItem:
        payload = chunk_bytes(reply)
        if payload is not None:
            self.sizes.append(len(payload))
        return reply


class StallAfterChunks:
    """After `n` data chunks, prints `PAUSED` on stdout and blocks that stream forever."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.seen = 0

    def __call__(self, reply: FetchItem) -> FetchItem:
        if chunk_bytes(reply) is not None:
            self.seen += 1
            if self.seen == self.n:
                print("PAUSED", flush=True)
                while True:
                    time.sleep(3600)
        return reply
