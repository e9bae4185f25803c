"""A node's store traffic in few etcd transactions: the agent relays its workers' `EtcdStore` sets
and reads (issue 34: a generation's rendezvous costs etcd requests a node, not a rank).

A gloo rendezvous makes every rank `set` its address, then read each peer's it connects to: three
etcd requests a rank with a lazy ring (bench/rendezvous_scale.py), 49,000 at 16,384 ranks, and
etcd's CPU grows with them. The ranks of a node set and read at about the same moment, so the
agent serves a Unix socket (Linux's abstract namespace, named in $ELASTIC_STORE_RELAY_SOCKET) and writes
what its workers sent together as one etcd transaction: group commit. A batch is what arrived
while the last transaction was in flight, plus what arrives within `LINGER_S` (2 ms) of its first
request; it goes at once when every open connection has a request in it (no more can come).

A batch is written as one transaction of its sets (the value's put and the drop of its `add`
deltas, as `EtcdStore.set`), then read as one transaction of its reads (a range `[k, k\\1)` each):
every read sees every set of its batch, and reports the revision it read at, from which a wait that
found a key missing watches. A transaction of reads alone is served like a range read, beside
etcd's apply loop; reads inside a transaction that also writes would be applied in that loop, one
at a time with every write (the first version did so: 4.5x fewer requests at 16,384 ranks, 12 %
less etcd CPU). A batch with two sets of one key (etcd refuses duplicate keys in a transaction), or
more operations than `MAX_OPS`, is cut into several, in order.

Only `set` and the reads of `get`, `check` and `wait` go through the relay; `add`, `compare_set`,
`append`, deletes and queues stay direct, and so does a wait's watch (it watches only its missing
keys, `store_waits.py`). Every call is answered once its transaction has committed: the contract
of a direct request. The relay retries a transaction while etcd cannot answer, as the client's own
calls do; a store whose relay fails (gone, refused, an error of etcd's) makes that request itself,
as it would with no relay.

When it pays (bench/README.md, "A store relay a node"): when a node's ranks make their calls
together, as processes on cores of their own do after the same generation record. Simulated with
a node's 8 ranks passing a barrier before each call (`rendezvous_scale.py --lockstep 8`), a lazy
rendezvous of 16,384 ranks made 0.7 etcd requests a rank instead of 3.0, and etcd spent 6.1
core-seconds instead of 9.7. With the simulation's 16,384 threads running free on 2 cores, a
node's calls spread over far more than the linger, a batch is mostly one request, the relay's
one thread a node serialises them, and the same rendezvous was slower and cost etcd more. Which
of the two a cluster's nodes are like is not measured here, so the relay is off unless asked for
(`ELASTIC_STORE_RELAY=1`).

Wire: one JSON object a line each way, one request in flight a connection. Request
`{"set": [key, value]}` or `{"read": [key, ...]}` (keys whole etcd keys, values base64); answer
`{"revision": R}` to a set, `{"revision": R, "reads": [[count, more, [[key, value, mod_revision],
...]], ...]}` to a read (each range read as `EtcdStore` makes it, `limit` kvs at most), or
`{"error": "..."}`.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from etcd3 import etcdrpc

from .client import etcd_unreachable
from .etcd_api import EtcdClient
from .local_socket import connect_abstract, send_line
from .store_keys import _DELTA, _END, _KEEP_LIMIT

log = logging.getLogger(__name__)

STORE_RELAY_SWITCH = "ELASTIC_STORE_RELAY"
"""`1` in an agent's environment (`ELASTIC_STORE_RELAY=1 elastic run ...`): the agent runs a store
relay for its workers. Off by default: module doc, "When it pays"."""
STORE_RELAY_ENV = "ELASTIC_STORE_RELAY_SOCKET"
"""The abstract socket name of this node's store relay (set by the agent for its workers)."""

MAX_OPS = 120
"""Operations in one transaction at most (etcd's default `--max-txn-ops` is 128)."""

LINGER_S = 0.002
"""How long a batch waits for more requests after its first, unless every open connection has
sent one (a node's ranks make the same store calls at about the same moment)."""
MAX_LINE = 1 << 24
"""Bytes of one request line at most (a set's value, base64); a connection that sends more is closed."""
_RETRY_PAUSE_S = 0.05


class StoreRelayError(RuntimeError):
    """The relay did not answer a request (gone, refused, malformed, or etcd's error)."""


@dataclass(frozen=True, kw_only=True)
class KV:
    """One key of a relayed read, as `EtcdStore`'s `_Counter` reads it."""

    key: bytes
    value: bytes
    mod_revision: int


@dataclass(frozen=True, kw_only=True)
class Read:
    """One relayed range read `[k, k\\1)`: how many keys it holds, whether `limit` cut it, its kvs."""

    count: int
    more: bool
    kvs: list[KV]


@dataclass(kw_only=True)
class _Request:
    conn: socket.socket
    sets: list[tuple[bytes, bytes]]
    reads: list[bytes]


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: object) -> bytes:
    if not isinstance(text, str):
        raise ValueError(f"expected a base64 string, got {text!r}")
    return base64.b64decode(text, validate=True)


def _parse(line: bytes) -> tuple[list[tuple[bytes, bytes]], list[bytes]]:
    """(sets, reads) of one request line; ValueError if malformed."""
    request = json.loads(line)
    if not isinstance(request, dict) or len(request) != 1:
        raise ValueError("a request is one of {\"set\": [key, value]} or {\"read\": [key, ...]}")
    if "set" in request:
        pair = request["set"]
        if not isinstance(pair, list) or len(pair) != 2:
            raise ValueError(f"a set is [key, value], got {pair!r}")
        return [(_unb64(pair[0]), _unb64(pair[1]))], []
    keys = request.get("read")
    if not isinstance(keys, list) or not keys:
        raise ValueError(f"a read is a non-empty list of keys, got {keys!r}")
    return [], [_unb64(k) for k in keys]


class StoreRelay:
    """The agent's side: one thread that takes its workers' store requests and commits each
    batch (module doc) as a transaction of its sets and one of its reads."""

    def __init__(self, client: EtcdClient, *, name: str, limit: int = _KEEP_LIMIT, timeout_s: float = 30.0,
                 linger_s: float = LINGER_S) -> None:
        """`limit`: kvs a read returns at most a key (`EtcdStore`'s); `timeout_s`: of a transaction;
        `linger_s`: how long a batch waits for more after its first request (module doc)."""
        self.client, self.name, self.limit, self.timeout_s = client, name, limit, timeout_s
        self.linger_s = linger_s
        self.requests = 0
        """etcd requests made so far (transactions, and range reads of a batch's only read)."""
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind("\0" + name)
        self._sock.listen(64)
        self._sock.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._sock, selectors.EVENT_READ)
        self._buffers: dict[socket.socket, bytes] = {}
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="store-relay", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving; a worker's next request (or one in flight) goes direct."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._thread.join(timeout=10.0)

    def _loop(self) -> None:
        try:
            while not self._closed:
                batch: list[_Request] = []
                self._take(self._selector.select(), batch)
                deadline = time.monotonic() + self.linger_s
                # every open connection has a request in: nothing more can come; else linger
                while batch and len({id(r.conn) for r in batch}) < len(self._buffers) and not self._closed:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self._take(self._selector.select(timeout=remaining), batch)
                if batch and not self._closed:
                    self._commit(batch)
        finally:
            for conn in list(self._buffers):
                conn.close()
            for sock in (self._sock, self._wake_r, self._wake_w):
                sock.close()
            self._selector.close()

    def _take(self, events: list[tuple[selectors.SelectorKey, int]], batch: list[_Request]) -> None:
        """Serve `events`; new connections' first requests join `batch` if already sent."""
        while events:
            accepted = [self._ready(key.fileobj, batch) for key, _ in events]  # type: ignore[arg-type]
            events = self._selector.select(timeout=0) if any(accepted) else []

    def _ready(self, sock: socket.socket, batch: list[_Request]) -> bool:
        """Accept every waiting connection (True), or queue the complete request lines a
        connection sent (False)."""
        if sock is self._wake_r:
            return False
        if sock is self._sock:
            while True:
                try:
                    conn, _ = self._sock.accept()
                except OSError:  # none left (BlockingIOError), or closed
                    return True
                conn.setblocking(True)
                self._buffers[conn] = b""
                self._selector.register(conn, selectors.EVENT_READ)
        try:
            data = sock.recv(1 << 16)
        except OSError:
            data = b""
        if not data:  # that worker is gone
            self._drop(sock)
            return False
        *lines, self._buffers[sock] = (self._buffers[sock] + data).split(b"\n")
        if len(self._buffers[sock]) > MAX_LINE:  # no request is that long: not a worker of ours
            with contextlib.suppress(OSError):
                send_line(sock, {"error": f"a request line over {MAX_LINE} bytes"})
            self._drop(sock)
            return False
        for line in lines:
            try:
                sets, reads = _parse(line)
            except (ValueError, TypeError) as exc:
                with contextlib.suppress(OSError):
                    send_line(sock, {"error": f"malformed request: {exc}"})
                continue
            batch.append(_Request(conn=sock, sets=sets, reads=reads))
        return False

    def _drop(self, sock: socket.socket) -> None:
        self._selector.unregister(sock)
        del self._buffers[sock]
        sock.close()

    def _commit(self, batch: list[_Request]) -> None:
        """Commit `batch` (its sets, then its reads; cut where etcd needs it), answer each request."""
        answers: list[dict[str, Any]] = [{} for _ in batch]
        try:
            for part in _parts(batch):
                # the sets, then the reads: each read sees every set of its batch, and reports the
                # revision it read at (a wait that finds a key missing watches from there)
                sets = [op for i in part for op in _set_ops(batch[i].sets)]
                reads = [op for i in part for op in _read_ops(batch[i].reads, self.limit)]
                written = self._call("Txn", etcdrpc.TxnRequest(success=sets)).header.revision if sets else 0
                ranges, revision = self._read(reads)
                results = iter(ranges)
                for i in part:
                    if batch[i].reads:
                        answers[i] = {"revision": revision,
                                      "reads": [_read_json(next(results)) for _ in batch[i].reads]}
                    else:
                        answers[i] = {"revision": int(written)}
        except Exception as exc:  # noqa: BLE001 - every request not yet answered gets it, and goes direct
            log.warning("store relay %s: a transaction of %d requests failed: %s", self.name, len(batch), exc)
            answers = [a or {"error": f"{type(exc).__name__}: {exc}"} for a in answers]
        for request, answer in zip(batch, answers, strict=True):
            with contextlib.suppress(OSError):  # that worker is gone
                send_line(request.conn, answer)

    def _read(self, reads: list[Any]) -> tuple[list[Any], int]:
        """(each range's answer, the revision they read at): a transaction of `reads`, or the one
        range read itself (what a store makes without a relay, which etcd serves for less)."""
        if not reads:
            return [], 0
        if len(reads) == 1:
            one = self._call("Range", reads[0].request_range)
            return [one], int(one.header.revision)
        txn = self._call("Txn", etcdrpc.TxnRequest(success=reads))
        return [r.response_range for r in txn.responses], int(txn.header.revision)

    def _call(self, method: str, request: Any) -> Any:
        """One etcd KV call (`Txn`, `Range`), retried while etcd cannot answer (as the client's
        own calls are), for `timeout_s` at most."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                response = getattr(etcdrpc.KVStub(self.client.channel), method)(
                    request, self.timeout_s, credentials=self.client.call_credentials, metadata=self.client.metadata,
                )
                self.requests += 1
                return response
            except Exception as exc:
                if not etcd_unreachable(exc) or time.monotonic() + _RETRY_PAUSE_S > deadline:
                    raise
                time.sleep(_RETRY_PAUSE_S)


def _parts(batch: Sequence[_Request]) -> list[list[int]]:
    """`batch`'s requests cut into runs, in order, whose sets one transaction can hold (and reads
    another)."""
    parts: list[list[int]] = [[]]
    ops, keys = 0, set[bytes]()
    for i, request in enumerate(batch):
        mine = 2 * len(request.sets) + len(request.reads)
        set_keys = {k for k, _ in request.sets}
        if parts[-1] and (ops + mine > MAX_OPS or set_keys & keys):
            parts.append([])
            ops, keys = 0, set[bytes]()
        parts[-1].append(i)
        ops += mine
        keys |= set_keys
    return parts


def _set_ops(sets: list[tuple[bytes, bytes]]) -> list[Any]:
    ops = []
    for key, value in sets:
        ops.append(etcdrpc.RequestOp(request_delete_range=etcdrpc.DeleteRangeRequest(key=key + _DELTA.encode(),
                                                                                     range_end=key + _END.encode())))
        ops.append(etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=key, value=value)))
    return ops


def _read_ops(keys: list[bytes], limit: int) -> list[Any]:
    return [etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(key=k, range_end=k + _END.encode(), limit=limit))
            for k in keys]


def _read_json(resp: Any) -> list[Any]:
    return [int(resp.count), bool(resp.more), [[_b64(kv.key), _b64(kv.value), int(kv.mod_revision)] for kv in resp.kvs]]


class StoreRelayClient:
    """A worker's side: one connection to its node's store relay, opened on first use, one
    request at a time (a store's threads take turns)."""

    def __init__(self, name: str, *, timeout_s: float = 60.0) -> None:
        self.name, self.timeout_s = name, timeout_s
        self._conn: socket.socket | None = None
        self._buffer = b""
        self._lock = threading.Lock()

    def set(self, key: str, value: bytes) -> int:
        """Set etcd key `key` (and drop its `add` deltas); the revision of the write."""
        return int(self._ask({"set": [_b64(key.encode()), _b64(value)]})["revision"])

    def read(self, keys: Sequence[str]) -> tuple[int, list[Read]]:
        """(the revision of the reads, each key's range read `[k, k\\1)`) in one transaction."""
        answer = self._ask({"read": [_b64(k.encode()) for k in keys]})
        try:
            reads = [Read(count=int(count), more=bool(more),
                          kvs=[KV(key=_unb64(k), value=_unb64(v), mod_revision=int(m)) for k, v, m in kvs])
                     for count, more, kvs in answer["reads"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise StoreRelayError(f"store relay {self.name!r}: malformed answer: {exc}") from None
        if len(reads) != len(keys):
            raise StoreRelayError(f"store relay {self.name!r}: {len(reads)} reads for {len(keys)} keys")
        return int(answer["revision"]), reads

    def close(self) -> None:
        with self._lock:
            self._drop()

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            try:
                if self._conn is None:
                    self._conn, self._buffer = connect_abstract(self.name, self.timeout_s), b""
                send_line(self._conn, request)
                while b"\n" not in self._buffer:
                    chunk = self._conn.recv(1 << 16)
                    if not chunk:
                        raise OSError("the relay closed the connection")
                    self._buffer += chunk
                line, self._buffer = self._buffer.split(b"\n", 1)
                answer = json.loads(line)
            except (OSError, ValueError) as exc:
                self._drop()
                raise StoreRelayError(f"store relay {self.name!r}: {exc}") from None
        if not isinstance(answer, dict) or "error" in answer or "revision" not in answer:
            error = answer.get("error") if isinstance(answer, dict) else answer
            raise StoreRelayError(f"store relay {self.name!r}: {error}")
        return answer

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def store_relay_from_env() -> StoreRelayClient | None:
    """This worker's store relay client, if its agent runs one ($ELASTIC_STORE_RELAY)."""
    name = os.environ.get(STORE_RELAY_ENV)
    return StoreRelayClient(name) if name else None
