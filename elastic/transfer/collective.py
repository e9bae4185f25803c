"""Collective shard transfer: move layer shards over a generation's process group with p2p sends.

The alternative to fetching shards over gRPC (`client.fetch_shards`): every worker of the new
generation calls `exchange` with the same move list (`plan_moves` makes one), and each move
`(key, src, dst)` travels as point-to-point `isend`/`irecv` on the group (gloo on CPU, NCCL on
CUDA; tensors stay on whatever device the caller's tensors and `device` name).

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

Every rank first posts all its sends (headers, then data), then all its header receives, then
waits for the headers one source at a time and posts the data receives; only then does it
wait for data (verifying each tensor while the next ones arrive), and for its own sends last.
Nothing blocks before everything it could depend on is posted, so two ranks that send to each
other both make progress. The messages of one pair match in posting order (gloo matches by
peer and tag, first posted first; NCCL ignores tags and keeps per-peer order). Every wait goes
through the caller's `wait` (an abortable wait in the runtime); errors of the group itself (a
peer died, the wait aborted) propagate unchanged.

Verification: each tensor carries a vectorised checksum in the header
(`elastic/transfer/shard_header.py`, which says why not CRC-32).

Why plain `isend`/`irecv`: `batch_isend_irecv` cannot take the backend process group objects
this project uses as groups (`P2POp` resolves peers through the group registry and raises
"not registered"), and for such groups it would only loop over `isend`/`irecv` anyway.
Caveat for NCCL (not measured: no multi-GPU machine here): without a coalesced group,
NCCL runs one pair's sends and receives in posting order on one stream, so two ranks that
send each other large tensors could stall; gloo, used here, has no such limit.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

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

Post = Callable[[str, torch.Tensor, int, int], dist.Work]
"""Posts a point-to-point operation: ("send" | "recv", tensor, peer rank, tag) -> its work (the
runtime's posts connect to a new peer abortably: elastic.parallel.groups.ParallelGroups.p2p)."""

HEADER_FRAME_BYTES = 64 << 10
"""Size of the fixed first header message of a pair (8-byte length + JSON, zero-padded)."""

_CPU = torch.device("cpu")
_LENGTH_BYTES = 8


@dataclass(frozen=True, kw_only=True)
class ShardMove:
    """One shard sent from one worker of the group to another."""

    key: ShardKey
    """The shard."""
    src: int
    """Group rank of the worker that sends it (a holder)."""
    dst: int
    """Group rank of the worker that receives it."""


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



# ---- planning ---------------------------------------------------------------------------------


def plan_moves(
    needs: Mapping[int, Sequence[ShardKey]], holders: Mapping[ShardKey, Sequence[int]]
) -> list[ShardMove]:
    """Pick a sender for every (shard, receiver) pair in `needs`, spreading load over holders.

    `needs`: receiver rank -> shards it must receive; `holders`: shard -> ranks that hold it.
    (shard, receiver) pairs are placed fewest-candidates-first (then by shard, receiver), each
    on the candidate that sends fewest shards so far (ties: lowest rank). A receiver is never
    its own sender; a pair with no other holder is left out (the caller fetches it another
    way). The result depends only on the contents, not on dict or list order, so every worker
    computes the same list; it is sorted by (src, dst, key).
    """
    held: dict[ShardKey, set[int]] = {}
    for key, ranks in holders.items():
        held.setdefault(ShardKey(*key), set()).update(ranks)
    wanted = sorted({(ShardKey(*key), dst) for dst, keys in needs.items() for key in keys})
    candidates = {(key, dst): sorted(held.get(key, set()) - {dst}) for key, dst in wanted}
    load: dict[int, int] = {}
    moves: list[ShardMove] = []
    for key, dst in sorted(wanted, key=lambda kd: (len(candidates[kd]), kd)):
        ranks = candidates[(key, dst)]
        if not ranks:
            continue
        src = min(ranks, key=lambda r: (load.get(r, 0), r))
        load[src] = load.get(src, 0) + 1
        moves.append(ShardMove(key=key, src=src, dst=dst))
    return sorted(moves, key=lambda m: (m.src, m.dst, m.key))



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


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.cpu().numpy().tobytes()


# ---- the exchange -----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class _Incoming:
    """The receive side of one pair: what to expect, the header, and the posted data receives."""

    src: int
    expected: list[ShardKey]
    shards: list[ShardHeader]
    posted: list[tuple[dist.Work, torch.Tensor]]


def exchange(
    group: dist.ProcessGroup,
    *,
    rank: int,
    moves: Sequence[ShardMove],
    export: Callable[[ShardKey], ShardState],
    wait: Callable[[dist.Work], None],
    tag: int = 7,
    device: torch.device = _CPU,
    post: Post | None = None,
) -> CollectiveResult:
    """Run this rank's part of `moves` over `group` (every member with moves calls it, same list).

    `rank` is my rank in `group`. For each move with `src == rank`, `export(key)` gives the
    tensors to send (called once per shard, however many receivers); an export that raises
    or returns something else than named tensors is reported to its receivers, who list the
    shard in `failed`. For each move with `dst == rank` the shard is received into fresh
    tensors on `device` (also where the header frames live: CPU for gloo, this rank's GPU for
    NCCL) and verified. `post` posts each send and receive (default: `dist.isend`/`dist.irecv`
    on `group`). `wait` blocks until one posted operation completed; it may raise
    (abort), and that error, like any error of the group, propagates unchanged. Moves must
    not repeat a (shard, receiver) pair nor send to their own sender (ValueError).
    """
    start = time.perf_counter()
    _check_moves(group, rank, moves)
    posting = post or functools.partial(_plain_post, group)
    outgoing: dict[int, list[ShardKey]] = {}
    incoming: dict[int, list[ShardKey]] = {}
    for m in moves:
        if m.src == rank:
            outgoing.setdefault(m.dst, []).append(ShardKey(*m.key))
        elif m.dst == rank:
            incoming.setdefault(m.src, []).append(ShardKey(*m.key))

    # 1. Every send, headers first (nothing here blocks).
    sends, bytes_sent = _post_sends(outgoing, export, posting, tag, device)
    # 2. Every header receive, then each source's data receives as soon as its header is in.
    pairs = _post_receives(incoming, posting, tag, wait, device)
    # 3. Data, each tensor verified as soon as it is in (while the next ones arrive).
    received: dict[ShardKey, ShardState] = {}
    failed: dict[ShardKey, str] = {}
    bytes_received = 0
    for pair in pairs:
        bytes_received += _receive_pair(pair, received, failed, wait, device)
    for work, _ in sends:
        wait(work)
    return CollectiveResult(
        shards=received,
        failed=failed,
        bytes_received=bytes_received,
        bytes_sent=bytes_sent,
        seconds=time.perf_counter() - start,
    )


def _post_sends(
    outgoing: dict[int, list[ShardKey]],
    export: Callable[[ShardKey], ShardState],
    posting: Post,
    tag: int,
    device: torch.device,
) -> tuple[list[tuple[dist.Work, torch.Tensor]], int]:
    """The send side: post, per receiver in rank order, its header frames and then its shards'
    tensors (each shard exported once, however many receivers); the posted sends (with their
    tensors, kept alive until waited for) and the tensor bytes sent. Nothing here blocks."""
    exported: dict[ShardKey, tuple[ShardHeader, list[torch.Tensor]]] = {}
    sends: list[tuple[dist.Work, torch.Tensor]] = []
    bytes_sent = 0
    for dst in sorted(outgoing):
        keys = sorted(outgoing[dst])
        for key in keys:
            if key not in exported:
                exported[key] = _export(key, export)
        messages = _header_frames(encode_header([exported[k][0] for k in keys]), device)
        for key in keys:
            messages += exported[key][1]
            bytes_sent += sum(t.numel() for t in exported[key][1])
        for t in messages:
            sends.append((posting("send", t, dst, tag), t))
    return sends, bytes_sent


def _post_receives(
    incoming: dict[int, list[ShardKey]],
    posting: Post,
    tag: int,
    wait: Callable[[dist.Work], None],
    device: torch.device,
) -> list[_Incoming]:
    """The receive side up to the data: post every source's header receive, then, one source at a
    time in rank order, wait for its header and post its data receives; one `_Incoming` per source."""
    first_frames = {
        src: _recv(posting, src, tag, torch.empty(HEADER_FRAME_BYTES, dtype=torch.uint8, device=device))
        for src in sorted(incoming)
    }
    pairs: list[_Incoming] = []
    for src in sorted(incoming):
        work, frame = first_frames[src]
        wait(work)
        raw = _read_header(posting, src, tag, frame, wait, device)
        shards = decode_header(raw)
        posted = [
            _recv(posting, src, tag, _receive_buffer(m.nbytes, device))
            for s in shards
            for m in s.tensors
            if m.nbytes > 0
        ]
        pairs.append(_Incoming(src=src, expected=sorted(incoming[src]), shards=shards, posted=posted))
    return pairs


def _receive_pair(
    pair: _Incoming,
    received: dict[ShardKey, ShardState],
    failed: dict[ShardKey, str],
    wait: Callable[[dist.Work], None],
    device: torch.device,
) -> int:
    """Wait for one source's data in header order, filling `received` and `failed`; bytes received.

    Every posted buffer is waited for, also those of shards that are dropped (not expected from
    this source, sent twice, or already failed), so the pair's stream is always fully drained.
    """
    buffers = iter(pair.posted)
    nbytes = 0
    for s in pair.shards:
        take = s.key in pair.expected and s.key not in received and s.key not in failed
        reason = check_names(s.tensors) if s.error is None else None
        state: ShardState = {}
        for meta in s.tensors:
            buf = None
            if meta.nbytes > 0:
                work, buf = next(buffers)
                wait(work)
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


def _check_moves(group: dist.ProcessGroup, rank: int, moves: Sequence[ShardMove]) -> None:
    size = group.size()
    if group.rank() != rank:
        raise ValueError(f"rank {rank} is not my rank in the group ({group.rank()})")
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


def _posted(work: dist.Work | None) -> dist.Work:
    assert work is not None, "this rank is not a member of the group"
    return work


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


def _plain_post(group: dist.ProcessGroup, op: str, t: torch.Tensor, peer: int, tag: int) -> dist.Work:
    work = (dist.isend(t, group=group, group_dst=peer, tag=tag) if op == "send"
            else dist.irecv(t, group=group, group_src=peer, tag=tag))
    return _posted(work)


def _recv(posting: Post, src: int, tag: int, buf: torch.Tensor) -> tuple[dist.Work, torch.Tensor]:
    return posting("recv", buf, src, tag), buf


def _read_header(
    posting: Post,
    src: int,
    tag: int,
    frame: torch.Tensor,
    wait: Callable[[dist.Work], None],
    device: torch.device,
) -> bytes:
    """The JSON of a received first frame, receiving its remainder if it did not fit."""
    head = _tensor_bytes(frame)
    length = int.from_bytes(head[:_LENGTH_BYTES], "little")
    room = HEADER_FRAME_BYTES - _LENGTH_BYTES
    if length <= room:
        return head[_LENGTH_BYTES : _LENGTH_BYTES + length]
    if length > 1 << 30:
        raise ProtocolError(f"header of {length} bytes from rank {src}")
    work, rest = _recv(posting, src, tag, torch.empty(length - room, dtype=torch.uint8, device=device))
    wait(work)
    return head[_LENGTH_BYTES:] + _tensor_bytes(rest)


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
