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

Verification. Each tensor's checksum covers its dtype, its shape and its bytes, the bytes
read as little-endian int64 words (the tail zero-padded to a word): the sum of the words, plus
the sum of the per-chunk sums (chunks of `CHECKSUM_CHUNK_WORDS` words) weighted by chunk index
+ 1, both modulo 2^64. A changed word changes the sum (by a non-zero amount below 2^64); chunks
that swapped places change the weighted sum; a header whose dtype or shape was altered no
longer matches the dtype/shape part. It does not see words permuted inside one 64 KiB chunk,
nor errors that cancel out: it guards against a buggy path (a wrong or stale buffer, a
truncation, an offset error), not against a forger, as CRC-32 does in `codec`.

Why not CRC-32 here: it would run on both sides, on the transfer's critical path. Measured on
the 2-core dev machine (one thread, 256 MiB of fp32, machine idle): zlib.crc32 7.3 GB/s
(`codec` quotes 1.2 GB/s, measured there earlier), SHA-256 2.2 GB/s, this checksum 36-44 GB/s
(memory-bound: one reduction over an int64 view of the tensor, no copy). With gloo over
loopback at ~3.3 GB/s, CRC-32 on both sides would alone drop the path to ~1.7 GB/s; this
checksum costs a few percent. Two traps measured on torch 2.13 CPU: `int32_view.sum(dtype=
torch.int64)` runs at only 1.3 GB/s (it converts first; hence int64 words), and torch's
multi-threaded reductions slow down 5-20x when the cores are busy with gloo's I/O (hence
numpy on CPU, see `_chunk_sums`). A mismatch puts the shard in `CollectiveResult.failed`; it
never raises.

Why plain `isend`/`irecv`: `batch_isend_irecv` cannot take the backend process group objects
this project uses as groups (`P2POp` resolves peers through the group registry and raises
"not registered"), and for such groups it would only loop over `isend`/`irecv` anyway.
Caveat for NCCL (not measured: no multi-GPU machine here): without a coalesced group,
NCCL runs one pair's sends and receives in posting order on one stream, so two ranks that
send each other large tensors could stall; gloo, used here, has no such limit.
"""

from __future__ import annotations

import json
import math
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch
import torch.distributed as dist

from elastic.transfer.shards import ShardKey

ShardState = dict[str, torch.Tensor]
"""Tensor name -> tensor of one shard (`param/<name>`, `exp_avg/<name>`, ..., `step`)."""

HEADER_FRAME_BYTES = 64 << 10
"""Size of the fixed first header message of a pair (8-byte length + JSON, zero-padded)."""
CHECKSUM_CHUNK_WORDS = 8192
"""int64 words per checksum chunk (64 KiB): the granularity of the position-weighted sum."""
HEADER_VERSION = 1

_T = TypeVar("_T")
_CPU = torch.device("cpu")
_LENGTH_BYTES = 8
_MASK64 = (1 << 64) - 1


class ProtocolError(RuntimeError):
    """A header that cannot be decoded: the stream of that pair cannot be followed any further."""


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


@dataclass(frozen=True, kw_only=True)
class TensorMeta:
    """One tensor as its header describes it."""

    name: str
    """The shard's name for the tensor."""
    dtype: str
    """torch dtype name without the `torch.` prefix, e.g. `bfloat16`."""
    shape: tuple[int, ...]
    """Shape (empty for a 0-d tensor)."""
    nbytes: int
    """Bytes on the wire (0: nothing is sent, the receiver makes an empty tensor)."""
    checksum: str
    """`tensor_checksum` of the sender's tensor."""


@dataclass(frozen=True, kw_only=True)
class ShardHeader:
    """One shard of a pair's header: its tensors, or why the holder could not export it."""

    key: ShardKey
    tensors: tuple[TensorMeta, ...]
    error: str | None = None


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


# ---- checksum and verification ----------------------------------------------------------------


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor: a view when contiguous, else one copy."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)  # (nbytes,)


def tensor_checksum(t: torch.Tensor) -> str:
    """Checksum of a tensor's dtype, shape and bytes (see the module docstring), as hex text.

    Runs on the tensor's device; one pass over its memory, no copy for a contiguous tensor
    whose data starts on an 8-byte boundary. Chunk i (from 0) of the int64 words weighs i + 1;
    the last, partial chunk also holds the zero-padded tail bytes.
    """
    data = _byte_view(t)
    whole = data.numel() // 8 * 8
    if data.storage_offset() % 8:
        data = data.clone()  # int64 view needs an 8-byte-aligned start (a view at an odd offset)
    words = data[:whole].view(torch.int64)  # (nwords,)
    full = words.numel() // CHECKSUM_CHUNK_WORDS
    total, weighted, rest = _chunk_sums(words, full)
    tail = bytes(data[whole:].cpu().tolist()).ljust(8, b"\0")
    rest += int.from_bytes(tail, "little", signed=True)
    total += rest
    weighted += rest * (full + 1)
    meta = zlib.crc32(f"{_dtype_name(t.dtype)}{tuple(t.shape)}".encode())
    return f"{total & _MASK64:016x}{weighted & _MASK64:016x}{meta:08x}"


def _chunk_sums(words: torch.Tensor, full: int) -> tuple[int, int, int]:
    """(sum of the `full` whole chunks, their index-weighted sum, sum of the words after them).

    On CPU through numpy: one thread, no OpenMP. torch's own `sum` splits a large reduction
    over its intra-op threads, and when the other cores are busy (gloo's I/O threads, the peer
    process) a thread waits for a descheduled one: measured 50-250 ms instead of 10-15 ms for
    256 MiB on the 2-core dev machine during a transfer. Both ways agree modulo 2^64.
    """
    if words.device.type == "cpu":
        return _chunk_sums_numpy(words, full)
    return _chunk_sums_torch(words, full)


def _chunk_sums_numpy(words: torch.Tensor, full: int) -> tuple[int, int, int]:
    n = full * CHECKSUM_CHUNK_WORDS
    w = words.numpy()
    sums = w[:n].reshape(full, CHECKSUM_CHUNK_WORDS).sum(axis=1)  # (full,), wraps
    weights = np.arange(1, full + 1, dtype=np.int64)
    return int(sums.sum()), int((sums * weights).sum()), int(w[n:].sum())


def _chunk_sums_torch(words: torch.Tensor, full: int) -> tuple[int, int, int]:
    n = full * CHECKSUM_CHUNK_WORDS
    sums = words[:n].view(full, CHECKSUM_CHUNK_WORDS).sum(dim=1)  # (full,), wraps
    weights = torch.arange(1, full + 1, dtype=torch.int64, device=words.device)
    total, weighted, rest = torch.stack([sums.sum(), (sums * weights).sum(), words[n:].sum()]).tolist()
    return int(total), int(weighted), int(rest)


def verify_shard(metas: Sequence[TensorMeta], tensors: Mapping[str, torch.Tensor]) -> str | None:
    """Check received tensors against their header: None when intact, else the first reason.

    Every name of the header must be there exactly once and nothing else, each tensor with the
    header's dtype, shape and checksum.
    """
    reason = _check_names(metas)
    if reason is not None:
        return reason
    names = {m.name for m in metas}
    missing, extra = names - set(tensors), set(tensors) - names
    if missing:
        return f"tensors {sorted(missing)} did not arrive"
    if extra:
        return f"unexpected tensors {sorted(extra)}"
    for m in metas:
        reason = _check_tensor(m, tensors[m.name])
        if reason is not None:
            return reason
    return None


def _check_names(metas: Sequence[TensorMeta]) -> str | None:
    names = [m.name for m in metas]
    if len(set(names)) != len(names):
        return f"header names a tensor twice: {sorted(n for n in set(names) if names.count(n) > 1)}"
    return None


def _check_tensor(m: TensorMeta, t: torch.Tensor) -> str | None:
    if _dtype_name(t.dtype) != m.dtype:
        return f"{m.name}: dtype {_dtype_name(t.dtype)}, header says {m.dtype}"
    if tuple(t.shape) != m.shape:
        return f"{m.name}: shape {tuple(t.shape)}, header says {m.shape}"
    got = tensor_checksum(t)
    if got != m.checksum:
        return f"{m.name}: checksum {got}, header says {m.checksum}"
    return None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _parse_dtype(name: str) -> torch.dtype | None:
    """The torch dtype called `name` (attribute lookup, no eval); None if there is none."""
    dtype = getattr(torch, name, None)
    return dtype if isinstance(dtype, torch.dtype) else None


# ---- headers ----------------------------------------------------------------------------------


def describe_shard(key: ShardKey, state: ShardState) -> ShardHeader:
    """The header entry of one exported shard (checksums computed here, on the tensors' device)."""
    if not isinstance(state, Mapping):
        return ShardHeader(key=key, tensors=(), error=f"export gave a {type(state).__name__}, not a dict")
    bad = sorted(str(n) for n, t in state.items() if not isinstance(n, str) or not isinstance(t, torch.Tensor))
    if bad:
        return ShardHeader(key=key, tensors=(), error=f"export gave non-tensor entries {bad}")
    metas = tuple(
        TensorMeta(
            name=name,
            dtype=_dtype_name(t.dtype),
            shape=tuple(t.shape),
            nbytes=t.numel() * t.element_size(),
            checksum=tensor_checksum(t),
        )
        for name, t in state.items()
    )
    return ShardHeader(key=key, tensors=metas)


def encode_header(shards: Sequence[ShardHeader]) -> bytes:
    doc = {
        "version": HEADER_VERSION,
        "shards": [
            {
                "key": list(s.key),
                "error": s.error,
                "tensors": [
                    {"name": m.name, "dtype": m.dtype, "shape": list(m.shape), "nbytes": m.nbytes, "checksum": m.checksum}
                    for m in s.tensors
                ],
            }
            for s in shards
        ],
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def decode_header(raw: bytes) -> list[ShardHeader]:
    """Parse a pair's header; ProtocolError if it is not one (wrong version, malformed fields)."""
    try:
        doc = json.loads(raw)
        if doc["version"] != HEADER_VERSION:
            raise ProtocolError(f"header version {doc['version']!r}, expected {HEADER_VERSION}")
        out = []
        for s in doc["shards"]:
            layer, tp_rank = s["key"]
            metas = tuple(
                TensorMeta(
                    name=_typed(m["name"], str),
                    dtype=_typed(m["dtype"], str),
                    shape=tuple(_typed(d, int) for d in m["shape"]),
                    nbytes=_typed(m["nbytes"], int),
                    checksum=_typed(m["checksum"], str),
                )
                for m in s["tensors"]
            )
            error = s["error"]
            if error is not None:
                error = _typed(error, str)
            out.append(ShardHeader(key=ShardKey(_typed(layer, int), _typed(tp_rank, int)), tensors=metas, error=error))
        if any(m.nbytes < 0 or min(m.shape, default=0) < 0 for s in out for m in s.tensors):
            raise ProtocolError("negative size in header")
        return out
    except ProtocolError:
        raise
    except (ValueError, KeyError, TypeError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ProtocolError(f"malformed shard header: {exc!r}") from exc


def _typed(value: object, kind: type[_T]) -> _T:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TypeError(f"{value!r} is not a {kind.__name__}")
    return value


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
) -> CollectiveResult:
    """Run this rank's part of `moves` over `group` (every member with moves calls it, same list).

    `rank` is my rank in `group`. For each move with `src == rank`, `export(key)` gives the
    tensors to send (called once per shard, however many receivers); an export that raises
    or returns something else than named tensors is reported to its receivers, who list the
    shard in `failed`. For each move with `dst == rank` the shard is received into fresh
    tensors on `device` (also where the header frames live: CPU for gloo, this rank's GPU for
    NCCL) and verified. `wait` blocks until one posted operation completed; it may raise
    (abort), and that error, like any error of the group, propagates unchanged. Moves must
    not repeat a (shard, receiver) pair nor send to their own sender (ValueError).
    """
    start = time.perf_counter()
    _check_moves(group, rank, moves)
    outgoing: dict[int, list[ShardKey]] = {}
    incoming: dict[int, list[ShardKey]] = {}
    for m in moves:
        if m.src == rank:
            outgoing.setdefault(m.dst, []).append(ShardKey(*m.key))
        elif m.dst == rank:
            incoming.setdefault(m.src, []).append(ShardKey(*m.key))

    # 1. Every send, headers first (nothing here blocks).
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
            sends.append((_posted(dist.isend(t, group=group, group_dst=dst, tag=tag)), t))

    # 2. Every header receive, then each source's data receives as soon as its header is in.
    first_frames = {
        src: _recv(group, src, tag, torch.empty(HEADER_FRAME_BYTES, dtype=torch.uint8, device=device))
        for src in sorted(incoming)
    }
    pairs: list[_Incoming] = []
    for src in sorted(incoming):
        work, frame = first_frames[src]
        wait(work)
        raw = _read_header(group, src, tag, frame, wait, device)
        shards = decode_header(raw)
        posted = [
            _recv(group, src, tag, _receive_buffer(m.nbytes, device))
            for s in shards
            for m in s.tensors
            if m.nbytes > 0
        ]
        pairs.append(_Incoming(src=src, expected=sorted(incoming[src]), shards=shards, posted=posted))

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
        reason = _check_names(s.tensors) if s.error is None else None
        state: ShardState = {}
        for meta in s.tensors:
            buf = None
            if meta.nbytes > 0:
                work, buf = next(buffers)
                wait(work)
                nbytes += meta.nbytes
            if take and s.error is None and reason is None:
                tensor = _rebuild(meta, buf, device)
                reason = tensor if isinstance(tensor, str) else _check_tensor(meta, tensor)
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
    return header, [_byte_view(state[m.name]) for m in header.tensors if m.nbytes > 0]


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


def _recv(group: dist.ProcessGroup, src: int, tag: int, buf: torch.Tensor) -> tuple[dist.Work, torch.Tensor]:
    return _posted(dist.irecv(buf, group=group, group_src=src, tag=tag)), buf


def _read_header(
    group: dist.ProcessGroup,
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
    work, rest = _recv(group, src, tag, torch.empty(length - room, dtype=torch.uint8, device=device))
    wait(work)
    return head[_LENGTH_BYTES:] + _tensor_bytes(rest)


def _rebuild(meta: TensorMeta, buf: torch.Tensor | None, device: torch.device) -> torch.Tensor | str:
    """A received tensor from its bytes (None: it had none); a reason if the header cannot describe it."""
    dtype = _parse_dtype(meta.dtype)
    if dtype is None:
        return f"{meta.name}: unknown dtype {meta.dtype!r}"
    if meta.nbytes != math.prod(meta.shape) * dtype.itemsize:
        return f"{meta.name}: {meta.nbytes} bytes cannot hold a {meta.dtype} tensor of shape {meta.shape}"
    if buf is None:
        return torch.empty(meta.shape, dtype=dtype, device=device)
    return buf.view(dtype).view(meta.shape)
