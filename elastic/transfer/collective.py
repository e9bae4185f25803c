"""Collective shard transfer: move layer shards over a generation's communicator, in groups.

The alternative to fetching shards over gRPC (`client.fetch_shards`): every worker of the new
generation that sends or receives a shard calls `exchange` with the same move list
(`elastic.transfer.moves.assign_moves` makes one), and each move `(key, src, dst)` travels as point-to-point operations
on the communicator (gloo on CPU, NCCL on CUDA; tensors stay on whatever device the caller's
tensors and `device` name).

Protocol, per (src, dst) pair that has at least one move (other pairs exchange nothing):

1. src sends a header frame: a uint8 tensor of `HEADER_FRAME_BYTES`, an 8-byte little-endian
   length then UTF-8 JSON listing, per shard (in the pair's move order) and per tensor: name,
   dtype, shape, byte count and checksum (or the reason the holder could not export the shard).
   A header longer than the frame sends its remainder as a second message of exactly that size.
   One fixed-size frame (rather than a length message, then the JSON) saves a round trip.
2. src sends every non-empty tensor of those shards, in header order, as a flat uint8 view of
   its own memory (no copy when it is contiguous; any dtype travels as bytes).
3. dst allocates each buffer from the header's byte count on its `device`, receives, then
   rebuilds each tensor (dtype, shape) and verifies it against the header.

Every rank posts its part of each phase as one group (elastic/comm/communicator.py): all its
first frames, sent and received, in one group; then the remainders of long headers, if any;
then every data send and receive in one group, whose receives it could size only once the
headers were in. Inside a group sends and receives progress together, so two ranks that move
shards to each other, or a rotation A -> B -> C -> A, make progress under NCCL's rules (posted
as single operations, each would wait for a peer that waits for another: a deadlock, and NCCL
would create a communicator per pair lazily, a blocking rendezvous inside the first send). Each
phase runs on the one communicator, so no pair communicator is ever created. The messages of one
pair match in posting order (gloo matches by peer and tag, first posted first; NCCL ignores tags
and keeps per-peer order). Every wait goes through the caller's `wait` (an abortable wait in the
runtime) and every read of a received header through its `fetch`; errors of the group itself (a
peer died, the wait aborted) propagate unchanged.

Verification: each tensor carries a vectorised checksum in the header
(`elastic/transfer/shard_header.py`, which says why not CRC-32).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from elastic.comm import P2P, Communicator, Handle
from elastic.transfer.moves import ShardMove
from elastic.transfer.shard_header import (
    ProtocolError,
    ShardHeader,
    ShardState,
    TensorMeta,
    byte_view,
    check_names,
    check_tensor,
    decode_header,
    describe_shard,
    encode_header,
    parse_dtype,
)
from elastic.transfer.shards import ShardKey

Post = Callable[[Sequence[P2P]], Handle]
"""Posts a group of point-to-point operations -> its handle (the runtime's posts connect to a
new peer abortably: elastic.parallel.groups.ParallelGroups.p2p)."""

HEADER_FRAME_BYTES = 64 << 10
"""Size of the fixed first header message of a pair (8-byte length + JSON, zero-padded)."""

_CPU = torch.device("cpu")
_LENGTH_BYTES = 8


@dataclass(frozen=True, kw_only=True)
class CollectiveResult:
    """What one rank received in an `exchange`, and what it cost."""

    shards: dict[ShardKey, ShardState]
    """Shards received and verified (dtype, shape, checksum and names all match the header)."""
    failed: dict[ShardKey, str]
    """Shards this rank should have received but did not get intact -> why (fetch them another way)."""
    bytes_received: int
    """Tensor data bytes received, failed shards included (header frames not counted)."""
    bytes_sent: int
    """Tensor data bytes sent (header frames not counted)."""
    seconds: float
    """Wall time of the whole exchange on this rank."""


def _header_frames(raw: bytes, device: torch.device) -> list[torch.Tensor]:
    """The first frame (length + start of the JSON, zero-padded), then the rest if any."""
    first = bytearray(HEADER_FRAME_BYTES)
    first[:_LENGTH_BYTES] = len(raw).to_bytes(_LENGTH_BYTES, "little")
    head = raw[: HEADER_FRAME_BYTES - _LENGTH_BYTES]
    first[_LENGTH_BYTES : _LENGTH_BYTES + len(head)] = head
    frames = [torch.frombuffer(first, dtype=torch.uint8).to(device)]
    rest = raw[len(head) :]
    if rest:
        frames.append(torch.frombuffer(bytearray(rest), dtype=torch.uint8).to(device))
    return frames


def _host_bytes(t: torch.Tensor) -> bytes:
    return t.cpu().numpy().tobytes()


# ---- the exchange -----------------------------------------------------------------------------


@dataclass(kw_only=True)
class _Incoming:
    """The receive side of one pair: what to expect, its first frame, then its header and buffers."""

    src: int
    expected: list[ShardKey]
    frame: torch.Tensor
    head: bytes = b""
    rest: torch.Tensor | None = None
    shards: list[ShardHeader] | None = None
    buffers: list[torch.Tensor] | None = None


def exchange(
    group: Communicator,
    *,
    rank: int,
    moves: Sequence[ShardMove],
    export: Callable[[ShardKey], ShardState],
    wait: Callable[[Handle], None],
    tag: int = 7,
    device: torch.device = _CPU,
    post: Post | None = None,
    fetch: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> CollectiveResult:
    """Run this rank's part of `moves` over `group` (every member with moves calls it, same list).

    `rank` is my rank in `group`. For each move with `src == rank`, `export(key)` gives the
    tensors to send (called once per shard, however many receivers); an export that raises
    or returns something else than named tensors is reported to its receivers, who list the
    shard in `failed`. For each move with `dst == rank` the shard is received into fresh
    tensors on `device` (also where the header frames live: CPU for gloo, this rank's GPU for
    NCCL) and verified. `post` posts each group of operations (default: `group.post`). `wait`
    blocks until one posted group completed, `fetch` reads a received header back to the host
    (default: a plain copy); either may raise (abort), and that error, like any error of the
    group, propagates unchanged. Moves must not repeat a (shard, receiver) pair nor send to
    their own sender (ValueError).
    """
    start = time.perf_counter()
    _check_moves(group, rank, moves)
    posting = post or group.post
    to_host = fetch or (lambda t: t.cpu())
    outgoing: dict[int, list[ShardKey]] = {}
    incoming: dict[int, list[ShardKey]] = {}
    for m in moves:
        if m.src == rank:
            outgoing.setdefault(m.dst, []).append(ShardKey(*m.key))
        elif m.dst == rank:
            incoming.setdefault(m.src, []).append(ShardKey(*m.key))

    headers, data, bytes_sent = _outgoing(outgoing, export, device)
    pairs = [_Incoming(src=src, expected=sorted(incoming[src]), frame=_frame_buffer(device)) for src in sorted(incoming)]

    # 1. Every first frame, sent and received, in one group.
    wait(posting([P2P("send", frames[0], dst, tag) for dst, frames in sorted(headers.items())]
                 + [P2P("recv", pair.frame, pair.src, tag) for pair in pairs]))
    # 2. The rest of the headers that did not fit their frame, if any (both sides know which).
    for pair in pairs:
        pair.head = _host_bytes(to_host(pair.frame))
        pair.rest = _rest_buffer(pair.head, pair.src, device)
    rests = ([P2P("send", frames[1], dst, tag) for dst, frames in sorted(headers.items()) if len(frames) > 1]
             + [P2P("recv", pair.rest, pair.src, tag) for pair in pairs if pair.rest is not None])
    if rests:
        wait(posting(rests))
    # 3. Every data send and receive in one group, once each header sized its buffers.
    receives: list[P2P] = []
    for pair in pairs:
        pair.shards = decode_header(_read_header(pair, to_host))
        pair.buffers = [_receive_buffer(m.nbytes, device) for s in pair.shards for m in s.tensors if m.nbytes > 0]
        receives += [P2P("recv", buf, pair.src, tag) for buf in pair.buffers]
    sends = [P2P("send", t, dst, tag) for dst, tensors in sorted(data.items()) for t in tensors]
    wait(posting(sends + receives))

    received: dict[ShardKey, ShardState] = {}
    failed: dict[ShardKey, str] = {}
    bytes_received = 0
    for pair in pairs:
        bytes_received += _verify_pair(pair, received, failed, device)
    return CollectiveResult(
        shards=received,
        failed=failed,
        bytes_received=bytes_received,
        bytes_sent=bytes_sent,
        seconds=time.perf_counter() - start,
    )


def _outgoing(
    outgoing: Mapping[int, list[ShardKey]], export: Callable[[ShardKey], ShardState], device: torch.device,
) -> tuple[dict[int, list[torch.Tensor]], dict[int, list[torch.Tensor]], int]:
    """Per destination, its header frames and its data tensors (byte views), and the tensor
    data bytes sent in all. Each shard is exported once, however many receivers it has."""
    exported: dict[ShardKey, tuple[ShardHeader, list[torch.Tensor]]] = {}
    headers: dict[int, list[torch.Tensor]] = {}
    data: dict[int, list[torch.Tensor]] = {}
    bytes_sent = 0
    for dst in sorted(outgoing):
        keys = sorted(outgoing[dst])
        for key in keys:
            if key not in exported:
                exported[key] = _export(key, export)
        headers[dst] = _header_frames(encode_header([exported[k][0] for k in keys]), device)
        data[dst] = [t for k in keys for t in exported[k][1]]
        bytes_sent += sum(t.numel() for t in data[dst])
    return headers, data, bytes_sent


def _frame_buffer(device: torch.device) -> torch.Tensor:
    return torch.empty(HEADER_FRAME_BYTES, dtype=torch.uint8, device=device)


def _rest_buffer(head: bytes, src: int, device: torch.device) -> torch.Tensor | None:
    """A buffer for the part of `src`'s header that did not fit its first frame (None: it fit)."""
    length = int.from_bytes(head[:_LENGTH_BYTES], "little")
    room = HEADER_FRAME_BYTES - _LENGTH_BYTES
    if length <= room:
        return None
    if length > 1 << 30:
        raise ProtocolError(f"header of {length} bytes from rank {src}")
    return torch.empty(length - room, dtype=torch.uint8, device=device)


def _read_header(pair: _Incoming, to_host: Callable[[torch.Tensor], torch.Tensor]) -> bytes:
    """The JSON of a pair's header: its first frame, and its remainder if it had one."""
    head = pair.head
    length = int.from_bytes(head[:_LENGTH_BYTES], "little")
    if pair.rest is None:
        return head[_LENGTH_BYTES : _LENGTH_BYTES + length]
    return head[_LENGTH_BYTES:] + _host_bytes(to_host(pair.rest))


def _verify_pair(
    pair: _Incoming, received: dict[ShardKey, ShardState], failed: dict[ShardKey, str], device: torch.device,
) -> int:
    """Rebuild and verify one source's shards in header order, filling `received` and `failed`;
    bytes received. Shards not expected from this source, sent twice or already failed are
    dropped (their bytes were received all the same: the pair's stream is always drained)."""
    assert pair.shards is not None and pair.buffers is not None
    buffers = iter(pair.buffers)
    nbytes = 0
    for s in pair.shards:
        take = s.key in pair.expected and s.key not in received and s.key not in failed
        reason = check_names(s.tensors) if s.error is None else None
        state: ShardState = {}
        for meta in s.tensors:
            buf = None
            if meta.nbytes > 0:
                buf = next(buffers)
                nbytes += meta.nbytes
            if take and s.error is None and reason is None:
                tensor = _rebuild(meta, buf, device)
                reason = tensor if isinstance(tensor, str) else check_tensor(meta, tensor)
                if not isinstance(tensor, str):
                    state[meta.name] = tensor
        if not take:
            continue
        if s.error is not None:
            failed[s.key] = f"holder rank {pair.src} could not export it: {s.error}"
        elif reason is not None:
            failed[s.key] = f"from holder rank {pair.src}: {reason}"
        else:
            received[s.key] = state
    for key in pair.expected:
        if key not in received and key not in failed:
            failed[key] = f"holder rank {pair.src} did not send it"
    return nbytes


def _check_moves(group: Communicator, rank: int, moves: Sequence[ShardMove]) -> None:
    size = group.size
    if group.rank != rank:
        raise ValueError(f"rank {rank} is not my rank in the group ({group.rank})")
    seen: set[tuple[ShardKey, int]] = set()
    for m in moves:
        if not (0 <= m.src < size and 0 <= m.dst < size):
            raise ValueError(f"{m}: ranks must lie in [0, {size})")
        if m.src == m.dst:
            raise ValueError(f"{m}: a rank cannot send a shard to itself")
        if (ShardKey(*m.key), m.dst) in seen:
            raise ValueError(f"{m}: rank {m.dst} receives shard {tuple(m.key)} twice")
        seen.add((ShardKey(*m.key), m.dst))


def _export(key: ShardKey, export: Callable[[ShardKey], ShardState]) -> tuple[ShardHeader, list[torch.Tensor]]:
    """Header entry and the byte views to send for one shard; an export error goes in the header."""
    try:
        state = export(key)
        if isinstance(state, Mapping):  # one contiguous copy of a strided tensor, for checksum and send
            state = {n: t.detach().contiguous() if isinstance(t, torch.Tensor) else t for n, t in state.items()}
        header = describe_shard(key, state)
    except Exception as exc:  # reported to the receivers, who fetch the shard another way
        return ShardHeader(key=key, tensors=(), error=f"{type(exc).__name__}: {exc}"), []
    if header.error is not None:
        return header, []
    return header, [byte_view(state[m.name]) for m in header.tensors if m.nbytes > 0]


def _receive_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """A fresh receive buffer, its pages touched on CPU before the receive is posted: the
    kernel's first-touch faults (zeroing every page) then run here while gloo's I/O thread
    receives the previous buffers, instead of inside that thread, serialised with the socket
    reads (measured here: the first exchange of 256 MiB into fresh memory went from 1.6 to
    2.5 GB/s)."""
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if device.type == "cpu":
        buf.numpy()[::4096] = 0  # one write per page: faults it in without a full memset
    return buf


def _rebuild(meta: TensorMeta, buf: torch.Tensor | None, device: torch.device) -> torch.Tensor | str:
    """A received tensor from its bytes (None: it had none); a reason if the header cannot describe it."""
    dtype = parse_dtype(meta.dtype)
    if dtype is None:
        return f"{meta.name}: unknown dtype {meta.dtype!r}"
    if meta.nbytes != math.prod(meta.shape) * dtype.itemsize:
        return f"{meta.name}: {meta.nbytes} bytes cannot hold a {meta.dtype} tensor of shape {meta.shape}"
    if buf is None:
        return torch.empty(meta.shape, dtype=dtype, device=device)
    return buf.view(dtype).view(meta.shape)
