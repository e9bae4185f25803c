"""Malformed, oversized and hostile gRPC messages against a live ShardServer, and malformed
replies against the client.

Requests are hand-made bytes sent over a raw channel (no serializer), so the server sees exactly
what a broken or hostile peer would send. Each bad request gets a clear status (INVALID_ARGUMENT,
RESOURCE_EXHAUSTED, NOT_FOUND, UNAUTHENTICATED) and the same server then serves a valid fetch,
bit for bit. On the client side a fake holder streams hand-made reply bytes (wrong chunk sizes,
checksum and length mismatches, a wrong shape, a truncated stream, unparseable bytes): alone it
makes `fetch_shards` raise TransferError, next to a good holder the fetch completes with the
good holder's exact bytes. No malformed reply ever comes back as a tensor.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable, Iterator, Mapping
from concurrent import futures

import grpc
import pytest
import torch

from elastic.transfer import shard_transfer_pb2 as pb
from elastic.transfer.client import FetchConfig, TransferError, fetch_shards
from elastic.transfer.server import ServerConfig, ShardServer
from elastic.transfer.shards import ShardKey
from elastic.transfer.wire import FETCH_METHOD, SERVICE
from tests.transfer.shard_data import make_shard, shards_equal

pytestmark = pytest.mark.timeout(60)

TOKEN = "bad-messages-token"
KEY = ShardKey(2, 0)
MAX_REQUEST = 16 << 10


def _config(**overrides: object) -> FetchConfig:
    return FetchConfig(**{"token": TOKEN, "generation": 0, "stall_timeout_s": 5.0, **overrides})  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def shards() -> dict[ShardKey, dict[str, torch.Tensor]]:
    return {KEY: make_shard(*KEY, numel=2048), ShardKey(3, 0): make_shard(3, 0, numel=512)}


@pytest.fixture(scope="module")
def server(shards: dict[ShardKey, dict[str, torch.Tensor]]) -> Iterator[ShardServer]:
    s = ShardServer(
        ServerConfig(token=TOKEN, max_request_bytes=MAX_REQUEST, chunk_bytes=1024),
        provider=lambda layer, tp: shards[ShardKey(layer, tp)],
    ).start()
    yield s
    s.stop()


def _raw_call(address: str, method: str, payload: bytes) -> grpc.StatusCode:
    """Send `payload` as the request bytes; the status the server answers with."""
    channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20)])
    try:
        if method == FETCH_METHOD:
            call = channel.unary_stream(method)(payload, timeout=10)
            try:
                for _ in call:
                    pass
            except grpc.RpcError as e:
                return e.code()
            return grpc.StatusCode.OK
        try:
            channel.unary_unary(method)(payload, timeout=10)
        except grpc.RpcError as e:
            return e.code()
        return grpc.StatusCode.OK
    finally:
        channel.close()


def _request(*shard_ids: tuple[int, int], token: str = TOKEN) -> bytes:
    return pb.FetchRequest(
        credentials=pb.Credentials(token=token, generation=0),
        shards=[pb.ShardId(layer=layer, tp_rank=tp) for layer, tp in shard_ids],
    ).SerializeToString()


def _still_serves(server: ShardServer, shards: Mapping[ShardKey, dict[str, torch.Tensor]]) -> None:
    result = fetch_shards([KEY], {server.address: [KEY]}, _config())
    assert shards_equal(result.shards[KEY], shards[KEY])


BAD_REQUESTS: dict[str, tuple[str, bytes, grpc.StatusCode]] = {
    # A field tag followed by a varint that never ends.
    "garbage bytes": (FETCH_METHOD, b"\xff" * 12, grpc.StatusCode.INVALID_ARGUMENT),
    # A valid request cut in the middle of its shard list.
    "truncated request": (FETCH_METHOD, _request((2, 0), (3, 0))[:-3], grpc.StatusCode.INVALID_ARGUMENT),
    "above max_request_bytes": (FETCH_METHOD, b"\x00" * (MAX_REQUEST + 1), grpc.StatusCode.RESOURCE_EXHAUSTED),
    "unknown shard": (FETCH_METHOD, _request((40, 0)), grpc.StatusCode.NOT_FOUND),
    "huge layer": (FETCH_METHOD, _request((2**31 - 1, 0)), grpc.StatusCode.NOT_FOUND),
    "negative layer": (FETCH_METHOD, _request((-1, 0)), grpc.StatusCode.INVALID_ARGUMENT),
    "negative tp_rank": (FETCH_METHOD, _request((2, -5)), grpc.StatusCode.INVALID_ARGUMENT),
    "no shards": (FETCH_METHOD, _request(), grpc.StatusCode.INVALID_ARGUMENT),
    "a shard twice": (FETCH_METHOD, _request((2, 0), (2, 0)), grpc.StatusCode.INVALID_ARGUMENT),
    "wrong token": (FETCH_METHOD, _request((2, 0), token="guess"), grpc.StatusCode.UNAUTHENTICATED),
    "no credentials": (FETCH_METHOD, pb.FetchRequest(shards=[pb.ShardId(layer=2)]).SerializeToString(),
                       grpc.StatusCode.UNAUTHENTICATED),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_gets_a_clear_status_and_the_server_keeps_serving(
    case: str, server: ShardServer, shards: dict[ShardKey, dict[str, torch.Tensor]]
) -> None:
    method, payload, want = BAD_REQUESTS[case]
    assert _raw_call(server.address, method, payload) == want
    _still_serves(server, shards)


def test_random_bytes_never_crash_the_server(
    server: ShardServer, shards: dict[ShardKey, dict[str, torch.Tensor]]
) -> None:
    # Random bytes either do not parse (INVALID_ARGUMENT) or parse into a request without the
    # token (UNAUTHENTICATED); never INTERNAL/UNKNOWN, never a reply.
    rng = random.Random(7)
    for _ in range(40):
        payload = bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 300)))
        code = _raw_call(server.address, FETCH_METHOD, payload)
        assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED), (payload, code)
    _still_serves(server, shards)


# ---- malformed replies ---------------------------------------------------------------------

Frames = list[bytes]


def _frames(tensors: Mapping[str, torch.Tensor], *, chunk: int = 1000) -> Frames:
    """The reply stream of a correct server for KEY, as serialized messages."""
    shard_id = pb.ShardId(layer=KEY.layer, tp_rank=KEY.tp_rank)
    out = [pb.FetchReply(shard_start=pb.ShardStart(shard=shard_id, num_tensors=len(tensors))).SerializeToString()]
    for name, t in tensors.items():
        data = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        start = pb.TensorStart(name=name, dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape),
                               nbytes=len(data))
        out.append(pb.FetchReply(tensor_start=start).SerializeToString())
        out += [pb.FetchReply(data=data[i : i + chunk]).SerializeToString() for i in range(0, len(data), chunk)]
        out.append(pb.FetchReply(tensor_end=pb.TensorEnd(crc32=zlib.crc32(data))).SerializeToString())
    out.append(pb.FetchReply(shard_end=pb.ShardEnd(shard=shard_id)).SerializeToString())
    return out


def _kind(frame: bytes) -> str | None:
    return pb.FetchReply.FromString(frame).WhichOneof("item")


def _first(frames: Frames, kind: str) -> int:
    return next(i for i, f in enumerate(frames) if _kind(f) == kind)


def _longer_chunk(frames: Frames) -> Frames:
    i = _first(frames, "data")
    frames[i] = pb.FetchReply(data=pb.FetchReply.FromString(frames[i]).data + b"\x00" * 8).SerializeToString()
    return frames


def _dropped_chunk(frames: Frames) -> Frames:
    del frames[_first(frames, "data")]
    return frames


def _flipped_bit(frames: Frames) -> Frames:
    i = _first(frames, "data")
    data = bytearray(pb.FetchReply.FromString(frames[i]).data)
    data[3] ^= 0x01
    frames[i] = pb.FetchReply(data=bytes(data)).SerializeToString()
    return frames


def _wrong_nbytes(frames: Frames) -> Frames:
    i = _first(frames, "tensor_start")
    start = pb.FetchReply.FromString(frames[i]).tensor_start
    start.nbytes += 4
    frames[i] = pb.FetchReply(tensor_start=start).SerializeToString()
    return frames


def _huge_tensor(frames: Frames) -> Frames:
    i = _first(frames, "tensor_start")
    start = pb.TensorStart(name="weight", dtype="float32", shape=[1 << 40], nbytes=4 << 40)
    frames[i] = pb.FetchReply(tensor_start=start).SerializeToString()
    return frames


def _transposed_shape(frames: Frames) -> Frames:
    # Same bytes, same count, valid checksum: only the receiver's shape check can tell.
    i = _first(frames, "tensor_start")
    start = pb.FetchReply.FromString(frames[i]).tensor_start
    assert start.name == "weight" and len(start.shape) == 2
    start.shape[:] = [start.shape[1], start.shape[0]]
    frames[i] = pb.FetchReply(tensor_start=start).SerializeToString()
    return frames


def _truncated(frames: Frames) -> Frames:
    return frames[: _first(frames, "data") + 1]


def _garbage(frames: Frames) -> Frames:
    frames.insert(2, b"\xff\xff\xff\xff")
    return frames


def _data_outside_tensor(frames: Frames) -> Frames:
    frames.insert(1, pb.FetchReply(data=b"\x01\x02").SerializeToString())
    return frames


def _empty_reply(frames: Frames) -> Frames:
    frames.insert(1, b"")
    return frames


BAD_REPLIES: dict[str, tuple[Callable[[Frames], Frames], str]] = {
    "chunk longer than announced": (_longer_chunk, "more than the announced"),
    "chunk missing": (_dropped_chunk, "received .* of .* bytes|checksum"),
    "checksum mismatch": (_flipped_bit, "checksum mismatch"),
    "header byte count wrong": (_wrong_nbytes, "header says"),
    "huge tensor announced": (_huge_tensor, "more than the .* accepted"),
    "wrong shape": (_transposed_shape, "rejected by the receiver: .*shape"),
    "truncated stream": (_truncated, "stream ended before"),
    "unparseable reply": (_garbage, "INTERNAL"),
    "data outside a tensor": (_data_outside_tensor, "data chunk outside a tensor"),
    "empty reply": (_empty_reply, "no known item"),
}


class FakeHolder:
    """A gRPC server that answers every Fetch with the given raw reply frames."""

    def __init__(self, frames: Frames) -> None:
        self.frames = frames
        self.calls = 0

        def fetch(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
            self.calls += 1
            yield from self.frames

        handler = grpc.unary_stream_rpc_method_handler(fetch)  # raw bytes in and out
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Fetch": handler}),))
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self._server.stop(None).wait()


def _check_shapes(expected: Mapping[ShardKey, dict[str, torch.Tensor]]) -> Callable[..., None]:
    def check(key: ShardKey, tensors: Mapping[str, torch.Tensor]) -> None:
        want = expected[key]
        for name, t in tensors.items():
            if name not in want or t.shape != want[name].shape or t.dtype != want[name].dtype:
                raise ValueError(f"{name}: got {t.dtype}{list(t.shape)}, expected shape {list(want[name].shape)}")

    return check


def test_the_fake_holder_serves_correct_frames(shards: dict[ShardKey, dict[str, torch.Tensor]]) -> None:
    holder = FakeHolder(_frames(shards[KEY]))
    try:
        result = fetch_shards([KEY], {holder.address: [KEY]}, _config(), check=_check_shapes(shards))
        assert shards_equal(result.shards[KEY], shards[KEY])
    finally:
        holder.stop()


@pytest.mark.parametrize("case", list(BAD_REPLIES))
def test_malformed_reply_is_a_transfer_error_never_a_tensor(
    case: str, server: ShardServer, shards: dict[ShardKey, dict[str, torch.Tensor]]
) -> None:
    tamper, reason = BAD_REPLIES[case]
    holder = FakeHolder(tamper(_frames(shards[KEY])))
    check = _check_shapes(shards)
    try:
        with pytest.raises(TransferError, match=reason):
            fetch_shards([KEY], {holder.address: [KEY]}, _config(), check=check)
        assert holder.calls >= 1
        # Next to a good holder the fetch completes with the good bytes; if the bad holder was
        # tried first, its failure is on record.
        result = fetch_shards([KEY], {holder.address: [KEY], server.address: [KEY]}, _config(), check=check)
        assert shards_equal(result.shards[KEY], shards[KEY])
        assert result.bytes_by_holder.get(server.address, 0) > 0
    finally:
        holder.stop()
