"""The ShardTransfer gRPC server: streams the shards this worker holds to workers that need them.

The runtime gives it a provider `(layer, tp_rank) -> {name: tensor}` (raising KeyError for a
shard this worker does not hold) and keeps its generation current with `set_generation`. Every
call must carry the job token. The server has one method, Fetch: who holds what is published
in etcd (`holdings/`), never asked of a server.

Generation rule: a requester whose generation is *older* than the server's is refused
(FAILED_PRECONDITION): it is acting on a superseded plan. A *newer* requester is refused as
retryable (UNAVAILABLE, with the server's generation in the `server-generation` trailing
metadata): the holder has not yet resolved its in-flight step of the old generation, so what it
would serve might be from before that step's decision. The runtime moves the server to g+1
(`set_generation`) once that step is committed or discarded; the client retries until then.

Flood limits: a client with a valid token could open many streams or ask for many shards at
once, and every stream holds a CPU copy of the shards it serves. So at most
`max_concurrent_streams` Fetch calls are served at once; another waits up to `busy_wait_s` for
a free slot and is then refused as retryable (RESOURCE_EXHAUSTED with the `server-busy` trailing
metadata: the client asks again, as for a holder still behind); gRPC itself refuses calls beyond
`max_pending_calls` in its queue. A request naming more than `max_shards_per_request` shards, or
larger than `max_request_bytes`, is refused outright, and replies never exceed one chunk plus
`HEADER_ALLOWANCE`.
"""

from __future__ import annotations

import hmac
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass

import grpc
import torch

from elastic.transfer import shard_transfer_pb2 as pb
from elastic.transfer import shard_transfer_pb2_grpc as pb_grpc
from elastic.transfer.codec import crc32, encode_tensor, iter_chunks
from elastic.transfer.shards import ShardKey
from elastic.transfer.tls import TlsConfig
from elastic.transfer.wire import DataChunk, FetchItem, MalformedRequest, add_servicer

ShardProvider = Callable[[int, int], Mapping[str, torch.Tensor]]
"""`(layer, tp_rank) -> {name: tensor}`; raises KeyError for a shard that is not held here."""

HEADER_ALLOWANCE = 64 << 10
"""Bytes allowed on top of a data chunk in one reply message (tensor names, shapes, framing)."""

GENERATION_BEHIND_KEY = "server-generation"
"""Trailing-metadata key of an UNAVAILABLE answer to a newer requester: the server's generation."""

SERVER_BUSY_KEY = "server-busy"
"""Trailing-metadata key of a RESOURCE_EXHAUSTED answer that means "too many streams now, retry"
(value: the server's `max_concurrent_streams`), as opposed to an oversized request."""

MISSING_SHARDS_KEY = "missing-shards"
"""Trailing-metadata key of a NOT_FOUND answer: the missing shards as `layer:tp_rank,...`."""


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """How a ShardTransfer server listens and streams."""

    token: str
    """The job token; a call presenting any other token is refused (UNAUTHENTICATED)."""
    host: str = "127.0.0.1"
    """Interface to bind; loopback by default."""
    port: int = 0
    """TCP port; 0 picks a free one (read it back from `ShardServer.port`)."""
    chunk_bytes: int = 4 << 20
    """Largest data chunk per reply message (a requester may ask for smaller ones)."""
    max_request_bytes: int = 64 << 10
    """Largest request message accepted; larger ones are refused with RESOURCE_EXHAUSTED."""
    max_workers: int = 8
    """Threads serving calls (streams and the refusals of busy ones)."""
    max_concurrent_streams: int = 4
    """Fetch calls served at once (each holds a CPU copy of its shards); more wait, then are
    refused as busy (retryable)."""
    busy_wait_s: float = 0.2
    """How long a call waits for a free stream slot before it is refused as busy."""
    max_pending_calls: int = 64
    """Calls gRPC accepts at once, running or queued; beyond, it refuses them (RESOURCE_EXHAUSTED)."""
    max_shards_per_request: int = 1024
    """Most shards one request may name (INVALID_ARGUMENT beyond)."""
    tls: TlsConfig | None = None
    """Mutual TLS (elastic/transfer/tls.py): serve only clients the CA signed; None: plain gRPC."""

    def __post_init__(self) -> None:
        if not self.token:
            raise ValueError("ServerConfig.token must be the (non-empty) job token")
        if self.chunk_bytes <= 0:
            raise ValueError(f"ServerConfig.chunk_bytes must be positive, got {self.chunk_bytes}")
        if self.max_request_bytes <= 0:
            raise ValueError(f"ServerConfig.max_request_bytes must be positive, got {self.max_request_bytes}")
        if self.max_workers <= 0:
            raise ValueError(f"ServerConfig.max_workers must be positive, got {self.max_workers}")
        for name in ("max_concurrent_streams", "max_pending_calls", "max_shards_per_request"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ServerConfig.{name} must be positive, got {getattr(self, name)}")
        if self.busy_wait_s < 0:
            raise ValueError(f"ServerConfig.busy_wait_s must be >= 0, got {self.busy_wait_s}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"ServerConfig.port must be in [0, 65535], got {self.port}")

    @property
    def max_reply_bytes(self) -> int:
        """The server's send limit: one chunk plus header allowance."""
        return self.chunk_bytes + HEADER_ALLOWANCE


class _Servicer(pb_grpc.ShardTransferServicer):
    def __init__(self, server: ShardServer) -> None:
        self._server = server

    def _check(self, request: pb.FetchRequest | MalformedRequest, context: grpc.ServicerContext) -> None:
        if isinstance(request, MalformedRequest):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"malformed {request.method} request (not a valid protobuf message): {request.error}",
            )
        assert not isinstance(request, MalformedRequest)
        credentials = request.credentials
        server = self._server
        if not hmac.compare_digest(credentials.token.encode(), server.config.token.encode()):
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "wrong or missing job token: this shard server serves only members of its job",
            )
        generation = server.generation
        if credentials.generation < generation:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"stale generation: the request is for generation {credentials.generation}, "
                f"this server is at generation {generation}",
            )
        if credentials.generation > generation:
            context.set_trailing_metadata(((GENERATION_BEHIND_KEY, str(generation)),))
            context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"generation {credentials.generation} not reached yet: this server is at generation "
                f"{generation} until its in-flight step is resolved; retry",
            )

    def Fetch(
        self, request: pb.FetchRequest | MalformedRequest, context: grpc.ServicerContext
    ) -> Iterator[FetchItem]:
        self._check(request, context)
        assert isinstance(request, pb.FetchRequest)
        server = self._server
        if len(request.shards) > server.config.max_shards_per_request:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the request names {len(request.shards)} shards, more than the "
                f"{server.config.max_shards_per_request} one request may name",
            )
        if not server.streams.acquire(timeout=server.config.busy_wait_s):
            server.note_busy()
            context.set_trailing_metadata(((SERVER_BUSY_KEY, str(server.config.max_concurrent_streams)),))
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"busy: {server.config.max_concurrent_streams} streams are being served; retry",
            )
        try:
            yield from self._serve(request, context)
        finally:
            server.streams.release()

    def _serve(self, request: pb.FetchRequest, context: grpc.ServicerContext) -> Iterator[FetchItem]:
        keys = [ShardKey(s.layer, s.tp_rank) for s in request.shards]
        if not keys:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the request names no shards")
        if len(set(keys)) != len(keys):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the request names a shard twice")
        negative = [k for k in keys if k.layer < 0 or k.tp_rank < 0]
        if negative:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"layer and tp_rank must be >= 0, got (layer={negative[0].layer}, tp_rank={negative[0].tp_rank})",
            )
        chunk = self._server.config.chunk_bytes
        if request.max_chunk_bytes:
            chunk = min(chunk, request.max_chunk_bytes)
        # Resolve every shard before sending a byte, so a missing one fails the call cleanly.
        shards: list[tuple[ShardKey, Mapping[str, torch.Tensor]]] = []
        missing: list[ShardKey] = []
        for key in keys:
            try:
                shards.append((key, self._server.provider(key.layer, key.tp_rank)))
            except KeyError:
                missing.append(key)
            except Exception as exc:  # the provider's bug must not surface as a bare UNKNOWN
                context.abort(
                    grpc.StatusCode.INTERNAL,
                    f"exporting shard (layer={key.layer}, tp_rank={key.tp_rank}) failed: "
                    f"{type(exc).__name__}: {exc}",
                )
        if missing:
            context.set_trailing_metadata(
                ((MISSING_SHARDS_KEY, ",".join(f"{k.layer}:{k.tp_rank}" for k in missing)),)
            )
            context.abort(
                grpc.StatusCode.NOT_FOUND,
                "this server does not hold shard(s) "
                + ", ".join(f"(layer={k.layer}, tp_rank={k.tp_rank})" for k in missing),
            )
        for key, tensors in shards:
            shard_id = pb.ShardId(layer=key.layer, tp_rank=key.tp_rank)
            yield pb.FetchReply(shard_start=pb.ShardStart(shard=shard_id, num_tensors=len(tensors)))
            for name, tensor in tensors.items():
                yield from _tensor_replies(name, tensor, chunk)
            yield pb.FetchReply(shard_end=pb.ShardEnd(shard=shard_id))


def _tensor_replies(name: str, tensor: torch.Tensor, chunk_bytes: int) -> Iterator[FetchItem]:
    header, data = encode_tensor(name, tensor)
    yield pb.FetchReply(
        tensor_start=pb.TensorStart(
            name=header.name, dtype=header.dtype, shape=header.shape, nbytes=header.nbytes
        )
    )
    crc = 0
    for piece in iter_chunks(data, chunk_bytes):
        crc = crc32(piece, crc)
        yield DataChunk(piece)  # serialized straight from the tensor's memory (see wire.py)
    yield pb.FetchReply(tensor_end=pb.TensorEnd(crc32=crc))


class ShardServer:
    """A running ShardTransfer service (use as a context manager, or `start()` / `stop()`)."""

    def __init__(
        self,
        config: ServerConfig,
        *,
        provider: ShardProvider,
        generation: int = 0,
        interceptors: Sequence[grpc.ServerInterceptor] = (),
    ) -> None:
        self.config = config
        self.provider = provider
        self._generation = generation
        self._lock = threading.Lock()
        self.streams = threading.BoundedSemaphore(config.max_concurrent_streams)
        """One slot per Fetch call being served (`ServerConfig.max_concurrent_streams`)."""
        self.busy_refusals = 0
        """Calls refused as busy so far."""
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=config.max_workers, thread_name_prefix="shard-server"),
            interceptors=list(interceptors),
            maximum_concurrent_rpcs=config.max_pending_calls,
            options=[
                ("grpc.max_receive_message_length", config.max_request_bytes),
                ("grpc.max_send_message_length", config.max_reply_bytes),
                ("grpc.so_reuseport", 0),
            ],
        )
        add_servicer(_Servicer(self), self._server)
        bind = f"{config.host}:{config.port}"
        if config.tls is not None:
            self.port = self._server.add_secure_port(bind, config.tls.server_credentials())
        else:
            self.port = self._server.add_insecure_port(bind)
        if self.port == 0:
            raise OSError(f"could not bind the shard server to {config.host}:{config.port}")

    @property
    def address(self) -> str:
        """`host:port` to give to clients."""
        return f"{self.config.host}:{self.port}"

    @property
    def generation(self) -> int:
        with self._lock:
            return self._generation

    def note_busy(self) -> None:
        """Count one call refused as busy."""
        with self._lock:
            self.busy_refusals += 1

    def set_generation(self, generation: int) -> None:
        """Move to a newer plan generation (requests for older ones are then refused)."""
        with self._lock:
            if generation < self._generation:
                raise ValueError(f"generation may only grow: {self._generation} -> {generation}")
            self._generation = generation

    def start(self) -> ShardServer:
        self._server.start()
        return self

    def stop(self, grace: float | None = None) -> None:
        """Stop serving; calls in flight get `grace` seconds to finish (None: cancelled now)."""
        self._server.stop(grace).wait()

    def __enter__(self) -> ShardServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
