"""Fetch shards from holders over gRPC: spread over holders, verified, re-fetched on failure.

    result = fetch_shards([(3, 0), (4, 0)], {"10.0.0.2:7001": [(3, 0), (4, 0)], ...}, config)
    result.shards[(3, 0)]["blocks.3.attn.qkv.weight"]      # a verified tensor

Each round spreads the still-missing shards over the holders that can serve them (see
`assign_shards`) and streams from those holders in parallel, one Fetch call per holder. A shard
whose tensor fails its checksum is fetched again in the next round, from another holder when
there is one; a holder whose call breaks (dead, hung past `stall_timeout_s`, closed) is dropped
and its unfinished shards move to others. Every shard gets at most `max_attempts` tries; after
that, or when no holder is left, `TransferError` says which shards failed and why. A reply that
breaks the protocol (data outside a tensor, a wrong byte count, a checksum mismatch, a header
announcing more than `max_tensor_bytes`, a truncated stream, bytes that do not parse) counts
as a failed try of that holder; so does a shard the caller's `check` rejects (wrong names,
dtypes or shapes). No tensor is handed out before its bytes and the caller's check pass. A refusal
that no other holder would answer differently (wrong token, stale generation, malformed or
oversized messages) ends the fetch at once. A holder still at an older generation answers
"not yet" (UNAVAILABLE with its generation): its shards are asked again every
`behind_retry_s` until `behind_wait_s` has passed, without counting as failed tries.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import torch

from elastic.transfer import shard_transfer_pb2 as pb
from elastic.transfer import shard_transfer_pb2_grpc as pb_grpc
from elastic.transfer.codec import CorruptTensorError, TensorAssembler, parse_header
from elastic.transfer.server import GENERATION_BEHIND_KEY, HEADER_ALLOWANCE, MISSING_SHARDS_KEY
from elastic.transfer.shards import ShardKey, assign_shards
from elastic.transfer.wire import fetch_callable

# Codes that another holder would answer the same way: retrying elsewhere cannot help.
_FATAL = frozenset(
    {
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)


ShardCheck = Callable[[ShardKey, Mapping[str, torch.Tensor]], None]
"""Raises ValueError when a received shard is not what the receiver expects (tensor names,
dtypes, shapes); the shard then counts as corrupt and is fetched again elsewhere."""


class TransferError(RuntimeError):
    """Shards could not be fetched; `failures` maps each failed shard to the reasons, in order."""

    def __init__(self, message: str, failures: Mapping[ShardKey, list[str]] | None = None) -> None:
        super().__init__(message)
        self.failures = dict(failures or {})


@dataclass(frozen=True, kw_only=True)
class FetchConfig:
    """How a client fetches shards."""

    token: str
    """The job token presented on every call."""
    generation: int
    """The requester's plan generation; holders at a newer one refuse the request."""
    max_reply_bytes: int = 16 << 20
    """Largest reply message accepted; the server is asked for chunks that fit in it."""
    max_request_bytes: int = 1 << 20
    """Largest request message this client sends."""
    max_tensor_bytes: int = 4 << 30
    """Largest tensor a reply may announce (its buffer is allocated up front); larger is corrupt."""
    max_attempts: int = 3
    """Tries per shard (first fetch included) before giving up on it."""
    stall_timeout_s: float = 30.0
    """A call that delivers nothing for this long is cancelled and its holder dropped."""
    parallel: int = 4
    """Holders streamed from at the same time."""
    behind_wait_s: float = 60.0
    """How long to keep asking a holder that has not reached the requester's generation yet."""
    behind_retry_s: float = 0.02
    """Pause between asks of such a holder."""

    def __post_init__(self) -> None:
        if not self.token:
            raise ValueError("FetchConfig.token must be the (non-empty) job token")
        if self.max_reply_bytes <= HEADER_ALLOWANCE:
            raise ValueError(f"FetchConfig.max_reply_bytes must exceed {HEADER_ALLOWANCE} bytes")
        if self.max_request_bytes <= 0:
            raise ValueError("FetchConfig.max_request_bytes must be positive")
        if self.max_tensor_bytes <= 0:
            raise ValueError("FetchConfig.max_tensor_bytes must be positive")
        if self.max_attempts < 1:
            raise ValueError(f"FetchConfig.max_attempts must be >= 1, got {self.max_attempts}")
        if self.stall_timeout_s <= 0:
            raise ValueError("FetchConfig.stall_timeout_s must be positive")
        if self.parallel < 1:
            raise ValueError(f"FetchConfig.parallel must be >= 1, got {self.parallel}")
        if self.behind_wait_s < 0 or self.behind_retry_s <= 0:
            raise ValueError("FetchConfig.behind_wait_s must be >= 0 and behind_retry_s positive")


@dataclass(frozen=True)
class FetchResult:
    """Verified shards plus what it cost to get them."""

    shards: dict[ShardKey, dict[str, torch.Tensor]]
    """Shard -> tensor name -> tensor, every tensor checksum-verified."""
    bytes_by_holder: dict[str, int]
    """Tensor data bytes received from each holder, discarded (corrupt) ones included."""
    seconds: float
    """Wall time of the whole fetch."""
    refetches: int
    """Shard fetches repeated after a checksum failure or a broken call."""
    incidents: dict[ShardKey, list[str]]
    """For each shard that needed more than one try, why each failed try failed."""

    @property
    def bytes_moved(self) -> int:
        """Tensor data bytes received in total."""
        return sum(self.bytes_by_holder.values())


@dataclass
class _Outcome:
    """What one Fetch call to one holder produced."""

    done: dict[ShardKey, dict[str, torch.Tensor]] = field(default_factory=dict)
    corrupt: dict[ShardKey, str] = field(default_factory=dict)
    nbytes: int = 0
    error: grpc.StatusCode | None = None
    error_text: str = ""
    missing: frozenset[ShardKey] = frozenset()
    behind: bool = False
    """The holder refused because it has not reached the requester's generation yet."""


class _Watchdog:
    """Cancels calls that have made no progress for `timeout` seconds (a hung or stopped holder)."""

    def __init__(self, timeout: float) -> None:
        self._timeout = timeout
        self._calls: dict[int, tuple[grpc.Call, list[float]]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shard-fetch-watchdog", daemon=True)
        self._thread.start()

    def track(self, call: grpc.Call) -> list[float]:
        stamp = [time.monotonic()]
        with self._lock:
            self._calls[id(call)] = (call, stamp)
        return stamp

    def untrack(self, call: grpc.Call) -> None:
        with self._lock:
            self._calls.pop(id(call), None)

    def _run(self) -> None:
        while not self._stop.wait(min(0.25, self._timeout / 4)):
            now = time.monotonic()
            with self._lock:
                stale = [c for c, stamp in self._calls.values() if now - stamp[0] > self._timeout]
            for call in stale:
                call.cancel()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def _channel(address: str, config: FetchConfig) -> grpc.Channel:
    return grpc.insecure_channel(
        address,
        options=[
            ("grpc.max_receive_message_length", config.max_reply_bytes),
            ("grpc.max_send_message_length", config.max_request_bytes),
            ("grpc.use_local_subchannel_pool", 1),
            ("grpc.enable_retries", 0),
        ],
    )


def _credentials(config: FetchConfig) -> pb.Credentials:
    return pb.Credentials(token=config.token, generation=config.generation)


def _fetch_from(
    address: str,
    channel: grpc.Channel,
    keys: list[ShardKey],
    config: FetchConfig,
    watchdog: _Watchdog,
    check: ShardCheck | None,
) -> _Outcome:
    """Stream `keys` from one holder; never raises for gRPC or data errors (see `_Outcome`)."""
    out = _Outcome()
    request = pb.FetchRequest(
        credentials=_credentials(config),
        shards=[pb.ShardId(layer=k.layer, tp_rank=k.tp_rank) for k in keys],
        max_chunk_bytes=config.max_reply_bytes - HEADER_ALLOWANCE,
    )
    call = fetch_callable(channel)(request, wait_for_ready=False)
    stamp = watchdog.track(call)
    wanted = set(keys)
    shard: ShardKey | None = None
    tensors: dict[str, torch.Tensor] = {}
    assembler: TensorAssembler | None = None
    bad: str | None = None
    expected_tensors = 0
    try:
        for reply in call:
            stamp[0] = time.monotonic()
            if isinstance(reply, memoryview) or reply.WhichOneof("item") == "data":
                data = reply if isinstance(reply, memoryview) else memoryview(reply.data)
                if assembler is None:
                    raise CorruptTensorError("data chunk outside a tensor")
                out.nbytes += len(data)
                if bad is None:
                    try:
                        assembler.add(data)
                    except CorruptTensorError as e:
                        bad = str(e)
                continue
            kind = reply.WhichOneof("item")
            if kind == "tensor_start":
                if shard is None or assembler is not None:
                    raise CorruptTensorError("tensor header outside a shard or inside another tensor")
                t = reply.tensor_start
                assembler = TensorAssembler(
                    parse_header(name=t.name, dtype=t.dtype, shape=list(t.shape), nbytes=t.nbytes,
                                 max_nbytes=config.max_tensor_bytes)
                )
            elif kind == "tensor_end":
                if assembler is None:
                    raise CorruptTensorError("tensor end without a tensor")
                if bad is None:
                    try:
                        tensors[assembler.header.name] = assembler.finish(reply.tensor_end.crc32)
                    except CorruptTensorError as e:
                        bad = str(e)
                assembler = None
            elif kind == "shard_start":
                key = ShardKey(reply.shard_start.shard.layer, reply.shard_start.shard.tp_rank)
                if shard is not None or key not in wanted or key in out.done or key in out.corrupt:
                    raise CorruptTensorError(f"unexpected start of shard {tuple(key)}")
                shard, tensors, bad = key, {}, None
                expected_tensors = reply.shard_start.num_tensors
            elif kind == "shard_end":
                if shard is None or assembler is not None:
                    raise CorruptTensorError("shard end outside a shard or inside a tensor")
                if bad is None and len(tensors) != expected_tensors:
                    bad = f"announced {expected_tensors} tensors, received {len(tensors)} distinct ones"
                if bad is None and check is not None:
                    try:
                        check(shard, tensors)
                    except ValueError as e:
                        bad = f"rejected by the receiver: {e}"
                if bad is None:
                    out.done[shard] = tensors
                else:
                    out.corrupt[shard] = bad
                shard = None
            else:
                raise CorruptTensorError(f"a reply with no known item ({kind!r})")
        if set(out.done) | set(out.corrupt) != wanted:
            raise CorruptTensorError("the stream ended before every requested shard was sent")
    except grpc.RpcError as e:
        out.error = e.code()
        out.error_text = f"{e.code().name}: {e.details()}"
        for k, v in e.trailing_metadata() or ():
            if k == GENERATION_BEHIND_KEY and e.code() == grpc.StatusCode.UNAVAILABLE:
                out.behind = True
            if k == MISSING_SHARDS_KEY:
                out.missing = frozenset(
                    ShardKey(*map(int, item.split(":"))) for item in str(v).split(",") if item
                )
        if e.code() == grpc.StatusCode.CANCELLED:
            out.error_text = f"no data for {config.stall_timeout_s} s (holder hung?); call cancelled"
    except CorruptTensorError as e:
        call.cancel()
        out.error = grpc.StatusCode.DATA_LOSS
        out.error_text = f"protocol violation: {e}"
    finally:
        watchdog.untrack(call)
    return out


def fetch_shards(
    wanted: Iterable[ShardKey],
    holders: Mapping[str, Iterable[ShardKey]],
    config: FetchConfig,
    *,
    check: ShardCheck | None = None,
) -> FetchResult:
    """Fetch every shard of `wanted` from `holders` (address -> shards it holds); see module doc.

    `check(shard, tensors)` may reject a received shard (ValueError), e.g. a wrong shape."""
    start = time.monotonic()
    keys = list(dict.fromkeys(ShardKey(*w) for w in wanted))
    holds = {address: {ShardKey(*s) for s in shards} for address, shards in holders.items()}
    orphans = [k for k in keys if not any(k in h for h in holds.values())]
    if orphans:
        raise ValueError(f"no holder is listed for shards {[tuple(k) for k in orphans]}")

    results: dict[ShardKey, dict[str, torch.Tensor]] = {}
    bytes_by_holder: dict[str, int] = {}
    failures: dict[ShardKey, list[str]] = {k: [] for k in keys}
    tried_bad: dict[ShardKey, set[str]] = {k: set() for k in keys}  # holders that sent it corrupt
    dead: set[str] = set()
    refetches = 0
    channels: dict[str, grpc.Channel] = {}
    watchdog = _Watchdog(config.stall_timeout_s)
    try:
        with futures.ThreadPoolExecutor(max_workers=config.parallel, thread_name_prefix="shard-fetch") as pool:
            while pending := [k for k in keys if k not in results]:
                candidates: dict[ShardKey, list[str]] = {}
                for k in pending:
                    alive = [a for a in holders if k in holds[a] and a not in dead]
                    fresh = [a for a in alive if a not in tried_bad[k]]
                    candidates[k] = fresh or alive  # a lone holder may be retried after a bad checksum
                if any(not c for c in candidates.values()):
                    stuck = {k: failures[k] for k, c in candidates.items() if not c}
                    raise TransferError(
                        "no live holder left for shards "
                        + ", ".join(f"{tuple(k)} ({'; '.join(r) or 'no holder'})" for k, r in stuck.items()),
                        failures,
                    )
                plan = assign_shards(candidates)
                jobs = {}
                for address, shard_keys in plan.items():
                    channel = channels.get(address) or channels.setdefault(address, _channel(address, config))
                    jobs[address] = pool.submit(_fetch_from, address, channel, shard_keys, config, watchdog, check)
                behind = False
                for address, job in jobs.items():
                    out = job.result()
                    bytes_by_holder[address] = bytes_by_holder.get(address, 0) + out.nbytes
                    results.update(out.done)
                    if out.behind:
                        # Not a failure: the holder resolves its in-flight step first; ask again.
                        if time.monotonic() - start > config.behind_wait_s:
                            raise TransferError(
                                f"holder {address} did not reach generation {config.generation} within "
                                f"{config.behind_wait_s:.0f} s: {out.error_text}",
                                failures,
                            )
                        behind = True
                        continue
                    for k, reason in out.corrupt.items():
                        failures[k].append(f"{address}: {reason}")
                        tried_bad[k].add(address)
                    unfinished = [k for k in plan[address] if k not in out.done and k not in out.corrupt]
                    if out.error is not None:
                        if out.error in _FATAL:
                            raise TransferError(
                                f"holder {address} refused the request: {out.error_text}", failures
                            )
                        if out.error == grpc.StatusCode.NOT_FOUND and out.missing:
                            # It named what it lacks; the rest of its shards are asked again, unpenalised.
                            holds[address] -= out.missing
                            unfinished = [k for k in unfinished if k in out.missing]
                        else:
                            dead.add(address)
                        for k in unfinished:
                            failures[k].append(f"{address}: {out.error_text}")
                    for k in plan[address]:
                        if k not in out.done:
                            refetches += 1
                            if len(failures[k]) >= config.max_attempts:
                                raise TransferError(
                                    f"shard {tuple(k)} failed {len(failures[k])} times: "
                                    + "; ".join(failures[k]),
                                    failures,
                                )
                if behind:
                    time.sleep(config.behind_retry_s)
    finally:
        watchdog.close()
        for channel in channels.values():
            channel.close()
    return FetchResult(
        shards={k: results[k] for k in keys},
        bytes_by_holder=bytes_by_holder,
        seconds=time.monotonic() - start,
        refetches=refetches,
        incidents={k: v for k, v in failures.items() if v},
    )


@dataclass(frozen=True)
class Holdings:
    """What one server reported holding."""

    shards: list[ShardKey]
    """The shards it can serve."""
    generation: int
    """Its plan generation."""


def list_shards(address: str, config: FetchConfig, *, timeout_s: float = 10.0) -> Holdings:
    """Ask one server what it holds; TransferError if it refuses or cannot be reached."""
    channel = _channel(address, config)
    start = time.monotonic()
    try:
        while True:
            try:
                reply = pb_grpc.ShardTransferStub(channel).List(
                    pb.ListRequest(credentials=_credentials(config)), timeout=timeout_s
                )
                break
            except grpc.RpcError as e:
                behind = e.code() == grpc.StatusCode.UNAVAILABLE and any(
                    k == GENERATION_BEHIND_KEY for k, _ in e.trailing_metadata() or ()
                )
                if behind and time.monotonic() - start < config.behind_wait_s:
                    time.sleep(config.behind_retry_s)
                    continue
                raise TransferError(f"List on {address} failed: {e.code().name}: {e.details()}") from e
    finally:
        channel.close()
    return Holdings(shards=[ShardKey(s.layer, s.tp_rank) for s in reply.shards], generation=reply.generation)
