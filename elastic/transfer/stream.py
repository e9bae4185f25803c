"""The receiving half of the Fetch protocol: one reply stream in, verified shards out (no gRPC).

A Fetch stream carries, for each requested shard: `shard_start`, then for each of its tensors
`tensor_start`, zero or more data chunks and `tensor_end` (the CRC-32), then `shard_end`.
`ShardStreamParser` is fed the replies in order and sorts out two kinds of trouble:

- a *bad shard* (a checksum or byte-count mismatch, the wrong number of tensors, a shard the
  caller's check rejects) goes to `corrupt` with the reason, and the stream goes on: the other
  shards of the call may still arrive intact;
- a *broken stream* (data outside a tensor, a header inside a tensor, a shard not asked for or
  sent twice, a tensor announced larger than the limit, a reply with no known item, a stream
  that ends before every requested shard) raises `CorruptTensorError`: nothing after it can be
  trusted.

No tensor reaches `done` before its bytes, its checksum and the caller's check pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch

from elastic.transfer import shard_transfer_pb2 as pb
from elastic.transfer.codec import CorruptTensorError, TensorAssembler, parse_header
from elastic.transfer.shards import ShardKey

ShardCheck = Callable[[ShardKey, Mapping[str, torch.Tensor]], None]
"""Raises ValueError when a received shard is not what the receiver expects (tensor names,
dtypes, shapes); the shard then counts as corrupt and is fetched again elsewhere."""

Reply = pb.FetchReply | memoryview
"""One item of a Fetch stream as the client reads it: a parsed reply, or a data chunk's bytes
(`elastic.transfer.wire` hands data chunks over as uncopied views)."""


class ShardStreamParser:
    """Turns one Fetch reply stream for the shards `wanted` into verified tensors.

    Call `feed` with each reply, then `finish` when the stream ends; read `done`, `corrupt` and
    `nbytes` at any point (also after a `CorruptTensorError`: shards finished before it stand).
    """

    def __init__(self, wanted: Iterable[ShardKey], *, max_tensor_bytes: int, check: ShardCheck | None = None) -> None:
        self.wanted = frozenset(wanted)
        self.max_tensor_bytes = max_tensor_bytes
        self.check = check
        self.done: dict[ShardKey, dict[str, torch.Tensor]] = {}
        """Shards received whole and verified."""
        self.corrupt: dict[ShardKey, str] = {}
        """Shards received damaged -> why."""
        self.nbytes = 0
        """Tensor data bytes received, damaged shards included."""
        self._shard: ShardKey | None = None
        self._expected_tensors = 0
        self._tensors: dict[str, torch.Tensor] = {}
        self._assembler: TensorAssembler | None = None
        self._bad: str | None = None
        """Why the current shard is damaged (its remaining bytes are still read, then dropped)."""

    def feed(self, reply: Reply) -> None:
        """Take the next reply of the stream; CorruptTensorError if it breaks the protocol."""
        if isinstance(reply, memoryview):
            self._data(reply)
            return
        kind = reply.WhichOneof("item")
        if kind == "data":
            self._data(memoryview(reply.data))
        elif kind == "tensor_start":
            self._tensor_start(reply.tensor_start)
        elif kind == "tensor_end":
            self._tensor_end(reply.tensor_end.crc32)
        elif kind == "shard_start":
            self._shard_start(reply.shard_start)
        elif kind == "shard_end":
            self._shard_end()
        else:
            raise CorruptTensorError(f"a reply with no known item ({kind!r})")

    def finish(self) -> None:
        """The stream has ended: CorruptTensorError unless every wanted shard was sent."""
        if set(self.done) | set(self.corrupt) != self.wanted:
            raise CorruptTensorError("the stream ended before every requested shard was sent")

    def _data(self, data: memoryview) -> None:
        if self._assembler is None:
            raise CorruptTensorError("data chunk outside a tensor")
        self.nbytes += len(data)
        if self._bad is None:
            try:
                self._assembler.add(data)
            except CorruptTensorError as e:
                self._bad = str(e)

    def _tensor_start(self, t: pb.TensorStart) -> None:
        if self._shard is None or self._assembler is not None:
            raise CorruptTensorError("tensor header outside a shard or inside another tensor")
        header = parse_header(name=t.name, dtype=t.dtype, shape=list(t.shape), nbytes=t.nbytes,
                              max_nbytes=self.max_tensor_bytes)
        self._assembler = TensorAssembler(header)

    def _tensor_end(self, crc: int) -> None:
        if self._assembler is None:
            raise CorruptTensorError("tensor end without a tensor")
        if self._bad is None:
            try:
                self._tensors[self._assembler.header.name] = self._assembler.finish(crc)
            except CorruptTensorError as e:
                self._bad = str(e)
        self._assembler = None

    def _shard_start(self, start: pb.ShardStart) -> None:
        key = ShardKey(start.shard.layer, start.shard.tp_rank)
        if self._shard is not None or key not in self.wanted or key in self.done or key in self.corrupt:
            raise CorruptTensorError(f"unexpected start of shard {tuple(key)}")
        self._shard, self._tensors, self._bad = key, {}, None
        self._expected_tensors = start.num_tensors

    def _shard_end(self) -> None:
        shard = self._shard
        if shard is None or self._assembler is not None:
            raise CorruptTensorError("shard end outside a shard or inside a tensor")
        bad = self._bad
        if bad is None and len(self._tensors) != self._expected_tensors:
            bad = f"announced {self._expected_tensors} tensors, received {len(self._tensors)} distinct ones"
        if bad is None and self.check is not None:
            try:
                self.check(shard, self._tensors)
            except ValueError as e:
                bad = f"rejected by the receiver: {e}"
        if bad is None:
            self.done[shard] = self._tensors
        else:
            self.corrupt[shard] = bad
        self._shard = None
