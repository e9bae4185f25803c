"""Fetch shards from holders over gRPC: spread over holders, verified, re-fetched on failure.

    a, b = ShardKey(3, 0), ShardKey(4, 0)
    result = fetch_shards([a, b], {"10.0.0.2:7001": [a, b], ...}, config)
    result.shards[a]["blocks.3.attn.qkv.weight"]      # a verified tensor

Where the holder map comes from is the caller's business (the runtime reads it from etcd,
`elastic.roles.holders`). Each round spreads the still-missing shards over the holders that can
serve them (a `FetchAssignment`, see `assign_shards`) and streams from those holders in
parallel, one Fetch call per holder (`elastic.transfer.stream` turns each reply stream into
verified tensors). A shard whose tensor fails its checksum is fetched again in the next round,
from another holder when there is one; a holder whose call breaks (dead, hung past
`stall_timeout_s`, closed) is dropped and its unfinished shards move to others. Every shard gets
at most `max_attempts` tries; after that, or when no holder is left, `TransferError` says which
shards failed and why. A reply that breaks the protocol counts as a failed try of that holder;
so does a shard the caller's `check` rejects (wrong names, dtypes or shapes). A refusal that no
other holder would answer differently (wrong token, stale generation, malformed or oversized
messages) ends the fetch at once. A holder still at an older generation answers "not yet"
(UNAVAILABLE with its generation in the `server-generation` trailer, `GenerationBehind` here):
its shards are asked again every `behind_retry_s`, without counting as failed tries, until
`behind_wait_s` has passed; then it is dropped like a broken holder. A holder serving as many
streams as it allows answers "busy" (RESOURCE_EXHAUSTED with the `server-busy` trailer, or gRPC's
own concurrent-call limit; `HolderBusy` here) and is asked again the same way.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from elastic.transfer import shard_transfer_pb2 as pb
from elastic.transfer.codec import CorruptTensorError
from elastic.transfer.server import (
    GENERATION_BEHIND_KEY,
    HEADER_ALLOWANCE,
    MISSING_SHARDS_KEY,
    SERVER_BUSY_KEY,
)
from elastic.transfer.shards import FetchAssignment, ShardKey, assign_shards
from elastic.transfer.stream import ShardCheck, ShardStreamParser
from elastic.transfer.tls import TlsConfig
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

Tensors = dict[str, torch.Tensor]
"""One shard's tensors by name."""


class TransferError(RuntimeError):
    """Shards could not be fetched; `failures` maps each failed shard to the reasons, in order."""

    def __init__(self, message: str, failures: Mapping[ShardKey, list[str]] | None = None) -> None:
        super().__init__(message)
        self.failures = dict(failures or {})


class GenerationBehind(TransferError):
    """A holder answered "not yet": it has not reached the requester's generation (it is still
    resolving its in-flight step of the one before). Raised by one Fetch call; `fetch_shards`
    asks that holder again until `FetchConfig.behind_wait_s` has passed."""

    def __init__(self, message: str, *, address: str, server_generation: int) -> None:
        super().__init__(message)
        self.address = address
        """The holder that answered."""
        self.server_generation = server_generation
        """The generation it is at."""


class HolderBusy(TransferError):
    """A holder answered "busy": it serves as many Fetch streams as it allows (or gRPC's queue of
    calls is full). Raised by one Fetch call; `fetch_shards` asks it again like a holder behind."""

    def __init__(self, message: str, *, address: str) -> None:
        super().__init__(message)
        self.address = address
        """The holder that answered."""


_GRPC_CALL_LIMIT = "Concurrent RPC limit exceeded"
"""Details of gRPC's own refusal beyond a server's `maximum_concurrent_rpcs`."""


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
    """How long (from the start of the fetch) to keep asking a holder that has not reached the
    requester's generation yet; after that it is dropped like a broken holder."""
    behind_retry_s: float = 0.02
    """Pause between asks of such a holder."""
    tls: TlsConfig | None = None
    """Mutual TLS (elastic/transfer/tls.py): talk only to servers the CA signed; None: plain gRPC."""

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


@dataclass(frozen=True, kw_only=True)
class FetchResult:
    """Verified shards plus what it cost to get them."""

    shards: dict[ShardKey, Tensors]
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


@dataclass(kw_only=True)
class _Outcome:
    """What one Fetch call to one holder produced; the shards it finished stand whatever broke after."""

    done: dict[ShardKey, Tensors] = field(default_factory=dict)
    corrupt: dict[ShardKey, str] = field(default_factory=dict)
    nbytes: int = 0
    error: grpc.StatusCode | None = None
    error_text: str = ""
    missing: frozenset[ShardKey] = frozenset()
    """The shards the holder said it does not hold (with NOT_FOUND)."""


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
    options: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", config.max_reply_bytes),
        ("grpc.max_send_message_length", config.max_request_bytes),
        ("grpc.use_local_subchannel_pool", 1),
        ("grpc.enable_retries", 0),
    ]
    if config.tls is not None:
        return grpc.secure_channel(address, config.tls.channel_credentials(), options=options + config.tls.channel_options())
    return grpc.insecure_channel(address, options=options)


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
    """Stream `keys` from one holder. gRPC and data errors end up in the outcome; only a "not
    yet" answer raises (GenerationBehind)."""
    parser = ShardStreamParser(keys, max_tensor_bytes=config.max_tensor_bytes, check=check)
    request = pb.FetchRequest(
        credentials=_credentials(config),
        shards=[pb.ShardId(layer=k.layer, tp_rank=k.tp_rank) for k in keys],
        max_chunk_bytes=config.max_reply_bytes - HEADER_ALLOWANCE,
    )
    call = fetch_callable(channel)(request, wait_for_ready=False)
    stamp = watchdog.track(call)
    failure: tuple[grpc.StatusCode | None, str, frozenset[ShardKey]] = (None, "", frozenset())
    try:
        for reply in call:
            stamp[0] = time.monotonic()
            parser.feed(reply)
        parser.finish()
    except grpc.RpcError as e:
        failure = _call_failure(address, e, config)
    except CorruptTensorError as e:
        call.cancel()
        failure = (grpc.StatusCode.DATA_LOSS, f"protocol violation: {e}", frozenset())
    finally:
        watchdog.untrack(call)
    error, text, missing = failure
    return _Outcome(done=parser.done, corrupt=parser.corrupt, nbytes=parser.nbytes, error=error,
                    error_text=text, missing=missing)


def _call_failure(
    address: str, e: grpc.RpcError, config: FetchConfig
) -> tuple[grpc.StatusCode, str, frozenset[ShardKey]]:
    """Why a Fetch call failed: its status, the reason to report and the shards the holder says
    it lacks. Raises GenerationBehind where the holder answered "not yet" (UNAVAILABLE with the
    server-generation trailer)."""
    code = e.code()
    text = f"{code.name}: {e.details()}"
    trailers = {k: str(v) for k, v in e.trailing_metadata() or ()}
    behind = trailers.get(GENERATION_BEHIND_KEY, "")
    if code == grpc.StatusCode.UNAVAILABLE and behind.isdigit():
        raise GenerationBehind(text, address=address, server_generation=int(behind))
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and (SERVER_BUSY_KEY in trailers
                                                       or _GRPC_CALL_LIMIT in (e.details() or "")):
        raise HolderBusy(text, address=address)
    missing = frozenset(
        ShardKey(*map(int, item.split(":"))) for item in trailers.get(MISSING_SHARDS_KEY, "").split(",") if item
    )
    if code == grpc.StatusCode.CANCELLED:
        text = f"no data for {config.stall_timeout_s} s (holder hung?); call cancelled"
    return code, text, missing


@dataclass(kw_only=True)
class _FetchState:
    """Where one `fetch_shards` call stands between rounds: what arrived, what failed and why,
    which holders are out."""

    config: FetchConfig
    started: float
    """`time.monotonic()` at the start of the fetch."""
    keys: list[ShardKey]
    """The shards wanted, in the caller's order."""
    holds: dict[str, set[ShardKey]]
    """Holder -> the shards it is believed to hold (less those it said it lacks), in the caller's order."""
    results: dict[ShardKey, Tensors] = field(default_factory=dict)
    bytes_by_holder: dict[str, int] = field(default_factory=dict)
    failures: dict[ShardKey, list[str]] = field(default_factory=dict)
    """Shard -> why each of its failed tries failed."""
    tried_bad: dict[ShardKey, set[str]] = field(default_factory=dict)
    """Shard -> the holders that sent it damaged."""
    dead: set[str] = field(default_factory=set)
    """Holders dropped: their call broke (dead, hung, closed) or they stayed behind too long."""
    refetches: int = 0

    @classmethod
    def begin(cls, wanted: Iterable[ShardKey], holders: Mapping[str, Iterable[ShardKey]],
              config: FetchConfig) -> _FetchState:
        keys = list(dict.fromkeys(ShardKey(*w) for w in wanted))
        holds = {address: {ShardKey(*s) for s in shards} for address, shards in holders.items()}
        orphans = [k for k in keys if not any(k in h for h in holds.values())]
        if orphans:
            raise ValueError(f"no holder is listed for shards {[tuple(k) for k in orphans]}")
        return cls(config=config, started=time.monotonic(), keys=keys, holds=holds,
                   failures={k: [] for k in keys}, tried_bad={k: set() for k in keys})

    def pending(self) -> list[ShardKey]:
        return [k for k in self.keys if k not in self.results]

    def assign(self) -> FetchAssignment:
        """This round's assignment of the pending shards to live holders, preferring those that
        have not sent the shard damaged (a lone holder may be asked again); TransferError when a
        shard has no live holder left."""
        candidates: dict[ShardKey, list[str]] = {}
        for k in self.pending():
            alive = [a for a, held in self.holds.items() if k in held and a not in self.dead]
            fresh = [a for a in alive if a not in self.tried_bad[k]]
            candidates[k] = fresh or alive
        stuck = {k: self.failures[k] for k, c in candidates.items() if not c}
        if stuck:
            raise TransferError(
                "no live holder left for shards "
                + ", ".join(f"{tuple(k)} ({'; '.join(r) or 'no holder'})" for k, r in stuck.items()),
                self.failures,
            )
        return assign_shards(candidates)

    def take_round(self, assignment: FetchAssignment, calls: Mapping[str, futures.Future[_Outcome]]) -> bool:
        """Take in the outcome of every call of a round; True when some holder said "not yet"
        (pause before the next round). TransferError when the fetch must stop."""
        waiting = False
        for address, call in calls.items():
            try:
                outcome = call.result()
            except (GenerationBehind, HolderBusy) as behind:
                waiting |= self._behind(address, assignment[address], behind)
                continue
            self._record(address, assignment[address], outcome)
        return waiting

    def _behind(self, address: str, keys: list[ShardKey], behind: GenerationBehind | HolderBusy) -> bool:
        """Not a failure while `behind_wait_s` lasts (True: ask again); after it, the holder is
        dropped like a broken one (False)."""
        config = self.config
        if time.monotonic() - self.started <= config.behind_wait_s:
            return True
        what = "stayed busy" if isinstance(behind, HolderBusy) else f"did not reach generation {config.generation}"
        text = f"{what} within {config.behind_wait_s:.0f} s: {behind}"
        self._record(address, keys, _Outcome(error=grpc.StatusCode.UNAVAILABLE, error_text=text))
        return False

    def _record(self, address: str, keys: list[ShardKey], out: _Outcome) -> None:
        self.bytes_by_holder[address] = self.bytes_by_holder.get(address, 0) + out.nbytes
        self.results.update(out.done)
        for k, reason in out.corrupt.items():
            self.failures[k].append(f"{address}: {reason}")
            self.tried_bad[k].add(address)
        if out.error is not None:
            self._broken_call(address, keys, out)
        for k in keys:
            if k not in out.done:
                self.refetches += 1
                if len(self.failures[k]) >= self.config.max_attempts:
                    raise TransferError(
                        f"shard {tuple(k)} failed {len(self.failures[k])} times: " + "; ".join(self.failures[k]),
                        self.failures,
                    )

    def _broken_call(self, address: str, keys: list[ShardKey], out: _Outcome) -> None:
        """A call that ended in an error: stop on a refusal every holder would repeat; drop the
        holder (or, when it named the shards it lacks, only those); a failed try for its
        unfinished shards."""
        if out.error in _FATAL:
            raise TransferError(f"holder {address} refused the request: {out.error_text}", self.failures)
        unfinished = [k for k in keys if k not in out.done and k not in out.corrupt]
        if out.error == grpc.StatusCode.NOT_FOUND and out.missing:
            # It named what it lacks; the rest of its shards are asked again, unpenalised.
            self.holds[address] -= out.missing
            unfinished = [k for k in unfinished if k in out.missing]
        else:
            self.dead.add(address)
        for k in unfinished:
            self.failures[k].append(f"{address}: {out.error_text}")

    def result(self) -> FetchResult:
        return FetchResult(
            shards={k: self.results[k] for k in self.keys},
            bytes_by_holder=self.bytes_by_holder,
            seconds=time.monotonic() - self.started,
            refetches=self.refetches,
            incidents={k: v for k, v in self.failures.items() if v},
        )


def fetch_shards(
    wanted: Iterable[ShardKey],
    holders: Mapping[str, Iterable[ShardKey]],
    config: FetchConfig,
    *,
    check: ShardCheck | None = None,
) -> FetchResult:
    """Fetch every shard of `wanted` from `holders` (address -> shards it holds); see module doc.

    `check(shard, tensors)` may reject a received shard (ValueError), e.g. a wrong shape."""
    state = _FetchState.begin(wanted, holders, config)
    channels: dict[str, grpc.Channel] = {}
    watchdog = _Watchdog(config.stall_timeout_s)
    try:
        with futures.ThreadPoolExecutor(max_workers=config.parallel, thread_name_prefix="shard-fetch") as pool:
            while state.pending():
                assignment = state.assign()
                calls = {}
                for address, keys in assignment.items():
                    channel = channels.get(address) or channels.setdefault(address, _channel(address, config))
                    calls[address] = pool.submit(_fetch_from, address, channel, keys, config, watchdog, check)
                if state.take_round(assignment, calls):
                    time.sleep(config.behind_retry_s)
    finally:
        watchdog.close()
        for channel in channels.values():
            channel.close()
    return state.result()

