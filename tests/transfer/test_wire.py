"""The hand-made framing of data chunks is exactly protobuf's, both ways."""

from __future__ import annotations

import pytest

from elastic.transfer import shard_transfer_pb2 as pb
from elastic.transfer.wire import DataChunk, decode_fetch_reply, encode_fetch_reply

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("n", [0, 1, 127, 128, 16383, 16384, 1 << 21])
def test_data_chunk_encoding_matches_protobuf(n: int) -> None:
    payload = bytes(i * 7 % 251 for i in range(n % 4096)) * (n // 4096) + bytes(n % 4096)
    wire = encode_fetch_reply(DataChunk(memoryview(payload)))
    assert wire == pb.FetchReply(data=payload).SerializeToString()
    assert pb.FetchReply.FromString(wire).data == payload
    decoded = decode_fetch_reply(wire)
    assert isinstance(decoded, memoryview) and decoded.tobytes() == payload


def test_other_replies_go_through_protobuf() -> None:
    start = pb.FetchReply(tensor_start=pb.TensorStart(name="w", dtype="float32", shape=[2, 3], nbytes=24))
    end = pb.FetchReply(tensor_end=pb.TensorEnd(crc32=0x1A1A1A1A))
    for reply in (start, end, pb.FetchReply()):
        wire = encode_fetch_reply(reply)
        assert wire == reply.SerializeToString()
        assert decode_fetch_reply(wire) == reply
