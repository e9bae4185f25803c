"""Tensor codec without gRPC: exact bytes for any dtype/shape/chunking, corruption detected."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic.transfer.codec import (
    CorruptTensorError,
    TensorAssembler,
    crc32,
    dtype_name,
    encode_tensor,
    iter_chunks,
    parse_header,
)
from tests.transfer.shard_data import bit_equal

pytestmark = pytest.mark.timeout(60)

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.float16, torch.uint8, torch.bool]


def round_trip(tensor: torch.Tensor, chunk_bytes: int) -> torch.Tensor:
    header, data = encode_tensor("t", tensor)
    header = parse_header(name=header.name, dtype=header.dtype, shape=list(header.shape), nbytes=header.nbytes)
    assembler = TensorAssembler(header)
    crc = 0
    for piece in iter_chunks(data, chunk_bytes):
        assembler.add(piece.tobytes())
        crc = crc32(piece, crc)
    return assembler.finish(crc)


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(0, 6), min_size=0, max_size=4),
    chunk_bytes=st.integers(1, 64),
    transpose=st.booleans(),
)
def test_round_trip_is_bit_exact(dtype: torch.dtype, shape: list[int], chunk_bytes: int, transpose: bool) -> None:
    tensor = (torch.randn(shape) * 100).to(dtype)
    if transpose and tensor.dim() >= 2:
        tensor = tensor.transpose(0, -1)  # non-contiguous
    assert bit_equal(round_trip(tensor, chunk_bytes), tensor)


def test_a_flipped_bit_fails_the_checksum() -> None:
    header, data = encode_tensor("w", torch.randn(100))
    assembler = TensorAssembler(header)
    raw = bytearray(data.tobytes())
    raw[17] ^= 0x01
    assembler.add(bytes(raw))
    with pytest.raises(CorruptTensorError, match="'w': checksum mismatch"):
        assembler.finish(crc32(data))


def test_short_and_overlong_data_are_rejected() -> None:
    header, data = encode_tensor("w", torch.randn(10))
    short = TensorAssembler(header)
    short.add(data[:39].tobytes())
    with pytest.raises(CorruptTensorError, match="received 39 of 40 bytes"):
        short.finish(crc32(data))
    long = TensorAssembler(header)
    with pytest.raises(CorruptTensorError, match="more than the announced 40"):
        long.add(data.tobytes() + b"x")


def test_inconsistent_or_unknown_headers_are_rejected() -> None:
    with pytest.raises(CorruptTensorError, match="unknown dtype 'object'"):
        parse_header(name="x", dtype="object", shape=[1], nbytes=8)
    with pytest.raises(CorruptTensorError, match=r"needs 24"):
        parse_header(name="x", dtype="float32", shape=[2, 3], nbytes=25)
    with pytest.raises(CorruptTensorError, match="negative dimension"):
        parse_header(name="x", dtype="float32", shape=[-1], nbytes=0)
    with pytest.raises(ValueError, match="cannot be transferred"):
        dtype_name(torch.quint8)
    with pytest.raises(ValueError, match="chunk_bytes must be positive"):
        list(iter_chunks(memoryview(b"abc"), 0))


def test_received_tensor_is_writable_and_owns_its_memory() -> None:
    source = torch.arange(6, dtype=torch.float32)
    got = round_trip(source, 5)
    got += 1  # the runtime will train on it in place
    assert torch.equal(source, torch.arange(6, dtype=torch.float32))
    assert torch.equal(got, torch.arange(1, 7, dtype=torch.float32))
