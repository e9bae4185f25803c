"""ShardStreamParser on hand-made Fetch replies, no server: what a correct stream yields, and
how a bad checksum, a truncated stream and an oversized chunk or tensor are told apart (a bad
shard is set aside and the stream goes on; a broken stream raises)."""

from __future__ import annotations

import zlib
from collections.abc import Mapping

import pytest
import torch

from elastic.transfer import shard_transfer_pb2 as pb
from elastic.transfer.codec import CorruptTensorError
from elastic.transfer.shards import ShardKey
from elastic.transfer.stream import ShardStreamParser
from tests.transfer.shard_data import make_shard, shards_equal

A, B = ShardKey(2, 0), ShardKey(3, 1)
CHUNK = 1000
LIMIT = 1 << 20


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _shard_replies(key: ShardKey, tensors: Mapping[str, torch.Tensor], *, as_views: bool = False) -> list[pb.FetchReply | memoryview]:
    """A correct server's replies for one shard; data chunks as FetchReply, or as the bare views
    the client's fast deserializer hands over (`as_views`)."""
    shard_id = pb.ShardId(layer=key.layer, tp_rank=key.tp_rank)
    out: list[pb.FetchReply | memoryview] = [
        pb.FetchReply(shard_start=pb.ShardStart(shard=shard_id, num_tensors=len(tensors)))
    ]
    for name, t in tensors.items():
        data = _raw(t)
        out.append(pb.FetchReply(tensor_start=pb.TensorStart(
            name=name, dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape), nbytes=len(data))))
        for i in range(0, len(data), CHUNK):
            piece = data[i : i + CHUNK]
            out.append(memoryview(piece) if as_views else pb.FetchReply(data=piece))
        out.append(pb.FetchReply(tensor_end=pb.TensorEnd(crc32=zlib.crc32(data))))
    out.append(pb.FetchReply(shard_end=pb.ShardEnd(shard=shard_id)))
    return out


@pytest.fixture(scope="module")
def shards() -> dict[ShardKey, dict[str, torch.Tensor]]:
    return {A: make_shard(*A, numel=1500), B: make_shard(*B, numel=700)}


def _feed(parser: ShardStreamParser, replies: list[pb.FetchReply | memoryview]) -> None:
    for reply in replies:
        parser.feed(reply)


def _first(replies: list[pb.FetchReply | memoryview], kind: str) -> int:
    return next(i for i, r in enumerate(replies) if not isinstance(r, memoryview) and r.WhichOneof("item") == kind)


@pytest.mark.parametrize("as_views", [False, True], ids=["messages", "views"])
def test_good_chunks_give_the_exact_tensors(shards: dict[ShardKey, dict[str, torch.Tensor]], as_views: bool) -> None:
    parser = ShardStreamParser([A, B], max_tensor_bytes=LIMIT)
    _feed(parser, _shard_replies(A, shards[A], as_views=as_views) + _shard_replies(B, shards[B], as_views=as_views))
    parser.finish()
    assert parser.done.keys() == {A, B} and parser.corrupt == {}
    for key in (A, B):
        assert shards_equal(parser.done[key], shards[key]), key
    assert parser.nbytes == sum(len(_raw(t)) for s in shards.values() for t in s.values())


def test_a_bad_crc_sets_the_shard_aside_and_the_stream_goes_on(shards: dict[ShardKey, dict[str, torch.Tensor]]) -> None:
    bad = _shard_replies(A, shards[A])
    i = _first(bad, "tensor_end")
    reply = bad[i]
    assert isinstance(reply, pb.FetchReply)
    bad[i] = pb.FetchReply(tensor_end=pb.TensorEnd(crc32=reply.tensor_end.crc32 ^ 1))
    parser = ShardStreamParser([A, B], max_tensor_bytes=LIMIT)
    _feed(parser, bad + _shard_replies(B, shards[B]))
    parser.finish()
    assert list(parser.done) == [B] and shards_equal(parser.done[B], shards[B])
    assert list(parser.corrupt) == [A] and "checksum mismatch" in parser.corrupt[A]


def test_a_truncated_stream_raises_and_keeps_what_finished(shards: dict[ShardKey, dict[str, torch.Tensor]]) -> None:
    second = _shard_replies(B, shards[B])
    parser = ShardStreamParser([A, B], max_tensor_bytes=LIMIT)
    _feed(parser, _shard_replies(A, shards[A]) + second[: _first(second, "data") + 1])
    with pytest.raises(CorruptTensorError, match="stream ended before every requested shard"):
        parser.finish()
    assert list(parser.done) == [A] and parser.corrupt == {}


def test_an_oversized_chunk_sets_the_shard_aside(shards: dict[ShardKey, dict[str, torch.Tensor]]) -> None:
    replies = _shard_replies(A, shards[A])
    i = _first(replies, "data")
    reply = replies[i]
    assert isinstance(reply, pb.FetchReply)
    replies[i] = pb.FetchReply(data=reply.data + b"\x00" * 8)
    parser = ShardStreamParser([A], max_tensor_bytes=LIMIT)
    _feed(parser, replies)
    parser.finish()
    assert parser.done == {} and "more than the announced" in parser.corrupt[A]


def test_a_tensor_announced_above_the_limit_breaks_the_stream(shards: dict[ShardKey, dict[str, torch.Tensor]]) -> None:
    replies = _shard_replies(A, shards[A])
    replies[_first(replies, "tensor_start")] = pb.FetchReply(
        tensor_start=pb.TensorStart(name="weight", dtype="float32", shape=[1 << 40], nbytes=4 << 40))
    parser = ShardStreamParser([A], max_tensor_bytes=LIMIT)
    with pytest.raises(CorruptTensorError, match="more than the .* accepted"):
        _feed(parser, replies)


@pytest.mark.parametrize(
    "case, pattern",
    [
        ("data outside a tensor", "data chunk outside a tensor"),
        ("unrequested shard", r"unexpected start of shard \(3, 1\)"),
        ("empty reply", "no known item"),
    ],
)
def test_protocol_violations_raise(shards: dict[ShardKey, dict[str, torch.Tensor]], case: str, pattern: str) -> None:
    replies = _shard_replies(A, shards[A])
    if case == "data outside a tensor":
        replies.insert(1, pb.FetchReply(data=b"\x01\x02"))
    elif case == "unrequested shard":
        replies = _shard_replies(B, shards[B])
    else:
        replies.insert(1, pb.FetchReply())
    parser = ShardStreamParser([A], max_tensor_bytes=LIMIT)
    with pytest.raises(CorruptTensorError, match=pattern):
        _feed(parser, replies)


def test_the_receivers_check_rejects_a_shard(shards: dict[ShardKey, dict[str, torch.Tensor]]) -> None:
    def check(key: ShardKey, tensors: Mapping[str, torch.Tensor]) -> None:
        raise ValueError(f"shard {tuple(key)} has the wrong shape")

    parser = ShardStreamParser([A], max_tensor_bytes=LIMIT, check=check)
    _feed(parser, _shard_replies(A, shards[A]))
    parser.finish()
    assert parser.done == {} and parser.corrupt[A] == "rejected by the receiver: shard (2, 0) has the wrong shape"
