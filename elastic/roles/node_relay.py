"""A node's etcd writes in one transaction: the agent relays what its workers report (issue 34 item 1).

At a generation change every worker writes its sync report with its holdings (halted; one
request, elastic/roles/worker_feeds.py `write_sync`), then its recovery record (first commit): with G
workers a node, 2 G etcd writes a node, and 2 W for the job, if each wrote its own. The agent serves a Unix socket
(Linux's abstract namespace, named in $ELASTIC_NODE_RELAY); a worker sends its puts there, and
the agent writes what its workers sent together in one etcd transaction: 2 writes a node per
change, whatever G. Puts keep their keys, values and leases. Sync reports and recovery records
are folds: the relay folds its workers' records into the node's one key of each
(elastic/roles/etcd_writes.py), keeping the last value it wrote to each such key as the base of
its next compare-and-swap.

Batching: the relay writes once every one of the node's live workers has a request waiting, or
`linger_s` after the first one came, whichever is first. A worker counts as live until its
connection closes (its process is gone: the kernel closes the socket). Waiting for the node's
slowest worker costs a change nothing, since the leader waits for every live worker's report
anyway; `linger_s` only bounds the wait for one that is stopped or stuck. A worker's call returns
once the transaction has committed: a report is as durable as a direct put. Without the variable
(torchrun's workers, which have no agent of ours), or when the agent does not answer, a worker
writes its puts itself, in one transaction (`put_all`).

An etcd stall can let the node's lease expire while the node lives: the agent registers again
under a new lease and `relet`s it here (elastic/roles/agent_rejoin.py). The keys the relay wrote
on the old lease are written again on the new one, later requests naming the old lease go on the
new one, and a batch that etcd refused for its lost lease waits for the relet (`RELET_WAIT_S`).

Wire: one JSON object a line each way. Request `{"puts": [[key, value, lease or null], ...],
"folds": [[key, kind, record JSON, lease or null], ...]}` ("folds" optional; kind "recovery",
"sync", "holdings" or "workers": etcd_writes.FOLD_KINDS), answer `{"ok": true}` or `{"error": "..."}`.
A connection whose first line is `{"watch": prefix}`
is a worker's feed connection instead (elastic/roles/node_feed.py): the agent's one watch of each
prefix it asks for feeds it, and it does not count as a worker.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from elastic.coordinator.etcd_api import EtcdClient
from elastic.coordinator.local_socket import connect_abstract, send_line
from elastic.roles.etcd_writes import FOLD_KINDS, Fold, Put, fold_kind, fold_lease, write_batch
from elastic.roles.node_feed import FeedHub, Outlet, watch_request

log = logging.getLogger(__name__)

RELAY_ENV = "ELASTIC_NODE_RELAY"
"""The abstract socket name of this node's relay (set by the agent for its workers)."""

LINGER_S = 1.0
"""How long the relay waits for the node's other live workers after the first request of a batch
(a bound for a stopped or stuck worker; the batch is written as soon as every live one has sent)."""

KNOWN_KEYS = 64
"""How many folded keys the relay remembers its last written value of (a node writes one a
generation; an older one is read again if it is ever folded into)."""


RELET_WAIT_S = 10.0
"""How long a batch naming a lease that etcd lost waits for the agent to register again under a
new one (`relet`: an etcd stall let the lease expire while the node lived) before its workers
get the error."""

LEASE_GONE = "requested lease not found"
"""etcd's answer to a write on a lease it no longer has."""


class RelayError(RuntimeError):
    """The relay did not take the puts (gone, refused, or its transaction failed)."""


@dataclass
class _Pending:
    conn: socket.socket
    puts: list[Put]
    folds: list[Fold]
    at: float = field(default_factory=time.monotonic)


class NodeRelay:
    """The agent's side: takes its `workers` workers' puts and writes each batch as one transaction."""

    def __init__(self, client: EtcdClient, *, name: str, workers: int, linger_s: float = LINGER_S) -> None:
        self.client, self.name, self.workers, self.linger_s = client, name, workers, linger_s
        self.transactions = 0
        """Transactions written so far (one per batch)."""
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind("\0" + name)
        self._sock.listen(max(8, 2 * workers))
        self._pending: list[_Pending] = []
        self._conns: set[socket.socket] = set()
        self._gone = 0
        """Workers whose connection closed while the relay served: not waited for any more."""
        self._cond = threading.Condition()
        self._closed = False
        self._hubs: dict[str, FeedHub] = {}
        """The node's one watch of each prefix its workers subscribed to."""
        self._feeds: set[socket.socket] = set()
        self._hub_lock = threading.Lock()
        self._known: dict[str, bytes | None] = {}
        """Folded key -> the value this relay last wrote or read there."""
        self._leases: dict[int, int] = {}
        """A lease the node lost while it lived -> the lease it registered under again (`relet`)."""
        self._leased: dict[str, tuple[bytes, int]] = {}
        """Key written on a lease -> (the value last written, that lease): what `relet` writes again."""
        threading.Thread(target=self._accept, name="relay-accept", daemon=True).start()
        threading.Thread(target=self._flush_loop, name="relay-flush", daemon=True).start()

    def close(self) -> None:
        """Stop taking requests; a worker waiting on one (or sending one later) puts directly."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            conns = [*self._conns, *self._feeds]
            hubs, self._hubs = list(self._hubs.values()), {}
        for hub in hubs:
            hub.close()
        for sock in (self._sock, *conns):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="relay-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        """Serve one connection: a worker's puts, or its feeds (its first line says which)."""
        with conn, conn.makefile("rb") as lines:
            first = lines.readline()
            if watch_request(first) is not None:
                self._feed(conn, itertools.chain([first], lines))
            else:
                self._serve_puts(conn, itertools.chain([first], lines))

    def _feed(self, conn: socket.socket, lines: Iterable[bytes]) -> None:
        """A worker's feed connection: each request line adds a prefix; until the worker goes."""
        with self._cond:
            if self._closed:
                return
            self._feeds.add(conn)
        outlet, joined = Outlet(conn), []
        try:
            for line in lines:
                prefix = watch_request(line)
                hub = self._hub(prefix) if prefix is not None else None
                if hub is not None:
                    hub.add(outlet)
                    joined.append(hub)
        except OSError:  # closed under it (close) or by the worker
            pass
        finally:
            for hub in joined:
                hub.remove(outlet)
            outlet.stop()
            with self._cond:
                self._feeds.discard(conn)

    def _hub(self, prefix: str) -> FeedHub | None:
        """The node's one watch of `prefix` (made on first use; None once the relay is closed)."""
        with self._hub_lock:  # its first etcd read outside the batches' lock
            with self._cond:
                if self._closed:
                    return None
                hub = self._hubs.get(prefix)
            if hub is None:
                hub = FeedHub(self.client, prefix)
                with self._cond:
                    if self._closed:
                        hub.close()
                        return None
                    self._hubs[prefix] = hub
            return hub

    def _serve_puts(self, conn: socket.socket, lines: Iterable[bytes]) -> None:
        """Queue each request of one worker's connection (it waits for the answer before the next)."""
        with self._cond:
            if self._closed:
                return
            self._conns.add(conn)
        try:
            for line in lines:
                if not line:
                    break
                try:
                    request = json.loads(line)
                    puts = [(str(k), str(v), None if lease is None else int(lease)) for k, v, lease in request["puts"]]
                    folds: list[Fold] = [(str(k), FOLD_KINDS[str(kind)].from_json(str(v)),
                                          None if lease is None else int(lease))
                                         for k, kind, v, lease in request.get("folds", [])]
                except (ValueError, TypeError, KeyError, AttributeError) as exc:  # a RecordError is a ValueError
                    send_line(conn, {"error": f"malformed request: {exc}"})
                    continue
                with self._cond:
                    self._pending.append(_Pending(conn, puts, folds))
                    self._cond.notify_all()
        except OSError:  # closed under it (close) or by the worker
            pass
        finally:
            with self._cond:
                self._conns.discard(conn)
                if not self._closed:  # that worker is gone: a batch no longer waits for it
                    self._gone += 1
                    self._cond.notify_all()

    def _batch(self) -> list[_Pending] | None:
        """The next batch: when every live worker has a request waiting, or `linger_s` after the first."""
        with self._cond:
            while not self._closed:
                if self._pending:
                    wait = self._pending[0].at + self.linger_s - time.monotonic()
                    live = max(1, self.workers - self._gone)
                    if len({id(p.conn) for p in self._pending}) >= live or wait <= 0:
                        batch, self._pending = self._pending, []
                        return batch
                    self._cond.wait(wait)
                else:
                    self._cond.wait()
            return None

    def relet(self, old: int, new: int) -> int:
        """The node re-registered under lease `new` after `old` expired while it lived (an etcd
        stall, elastic/coordinator/membership.py `rejoin`): write again every key this relay
        wrote on `old` (its workers' registrations and holdings went with the lease), on `new`,
        and put later requests naming `old` on `new` (the workers were started with `old`).
        Returns how many keys it wrote again."""
        with self._cond:
            again = {k: v for k, (v, lease) in self._leased.items() if lease == old}
        if again:  # values as written (a packed record is not text)
            ops = [self.client.transactions.put(k, v, lease=new) for k, v in again.items()]
            self.client.transaction(compare=[], success=ops, failure=[])
        with self._cond:  # then the batches that wait for the new lease go on (`_write`)
            for lost, now in list(self._leases.items()):
                if now == old:
                    self._leases[lost] = new
            self._leases[old] = new
            for key, value in again.items():
                self._leased[key] = (value, new)
                self._known[key] = value
            self._cond.notify_all()
        return len(again)

    def _lease(self, lease: int | None) -> int | None:
        return None if lease is None else self._leases.get(lease, lease)

    def _remember(self, puts: list[Put], folds: list[Fold]) -> None:
        """Keep the last value of each key written on a lease (for `relet`)."""
        for key, value, lease in puts:
            if lease is not None:
                self._leased[key] = (value.encode(), lease)
        for fold in folds:
            on, known = fold_lease(fold), self._known.get(fold[0])
            if on is not None and known is not None:
                self._leased[fold[0]] = (known, on)

    def _flush_loop(self) -> None:
        while (batch := self._batch()) is not None:
            answer = self._write(batch)
            for p in batch:
                with contextlib.suppress(OSError):  # that worker is gone
                    send_line(p.conn, answer)

    def _write(self, batch: list[_Pending]) -> dict[str, object]:
        """Write one batch as one transaction: the workers' answer. A lease it names that etcd no
        longer knows (it expired in an etcd stall while the node lived) is waited for: the agent
        registers again and `relet`s it, up to `RELET_WAIT_S`; then the batch goes on the new one."""
        deadline = time.monotonic() + RELET_WAIT_S
        while True:
            with self._cond:
                puts = [(k, v, self._lease(lease)) for p in batch for k, v, lease in p.puts]
                folds: list[Fold] = [(f[0], f[1], self._lease(fold_lease(f))) for p in batch for f in p.folds]
            try:
                self.transactions += write_batch(self.client, puts, folds, self._known)
                with self._cond:
                    self._remember(puts, folds)
                while len(self._known) > KNOWN_KEYS:
                    del self._known[next(iter(self._known))]
                return {"ok": True}
            except Exception as exc:  # noqa: BLE001 - handed to each worker, which then puts directly
                self._known.clear()  # a fold may have landed before the error: read keys again
                named = {lease for *_, lease in puts if lease is not None} | {
                    lease for f in folds if (lease := fold_lease(f)) is not None}
                if LEASE_GONE in str(exc) and named and self._relet_within(named, deadline):
                    continue
                log.warning("relay %s: a transaction of %d puts and %d folds failed: %s", self.name, len(puts),
                            len(folds), exc)
                return {"error": f"{type(exc).__name__}: {exc}"}

    def _relet_within(self, leases: set[int], deadline: float) -> bool:
        """Whether one of `leases` is `relet` (to a lease not in `leases`) before `deadline`."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self._closed or any(self._leases.get(lease, lease) not in leases for lease in leases),
                timeout=max(0.0, deadline - time.monotonic())) and not self._closed


class RelayClient:
    """A worker's side: one connection to its node's relay, opened on first use."""

    def __init__(self, name: str, *, timeout_s: float = 30.0) -> None:
        self.name, self.timeout_s = name, timeout_s
        self._conn: socket.socket | None = None
        self._lock = threading.Lock()

    def put(self, puts: list[Put], folds: list[Fold] | None = None) -> None:
        """Have the relay write `puts` and fold `folds` (in one transaction with other workers');
        RelayError if it did not."""
        with self._lock:
            try:
                if self._conn is None:
                    self._conn = connect_abstract(self.name, self.timeout_s)
                request: dict[str, object] = {"puts": puts}
                if folds:
                    request["folds"] = [[f[0], fold_kind(f[1]), f[1].to_json(), fold_lease(f)] for f in folds]
                send_line(self._conn, request)
                answer = json.loads(_read_line(self._conn))
            except (OSError, ValueError) as exc:
                self._close_locked()
                raise RelayError(f"node relay {self.name!r}: {exc}") from None
        if not answer.get("ok"):
            raise RelayError(f"node relay {self.name!r}: {answer.get('error')}")

    def close(self) -> None:
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _read_line(conn: socket.socket) -> bytes:
    """One answer line (answers are short, and one request is in flight at a time)."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(4096)
        if not chunk:
            raise OSError("the relay closed the connection")
        data += chunk
    return data


def relay_from_env() -> RelayClient | None:
    """This worker's relay client, if its agent runs one ($ELASTIC_NODE_RELAY)."""
    name = os.environ.get(RELAY_ENV)
    return RelayClient(name) if name else None


def put_all(client: EtcdClient, relay: RelayClient | None, puts: list[Put], folds: list[Fold] | None = None) -> None:
    """Write `puts` and fold `folds`: through the node's relay when there is one, else (or when it
    fails) as one transaction of this worker's own."""
    if relay is not None:
        try:
            relay.put(puts, folds)
            return
        except RelayError as exc:
            log.warning("%s; putting directly", exc)
    write_batch(client, puts, folds or [], {})
