"""The second witness of a lease expiry: a direct liveness probe of a node's agent over gRPC.

A lease that expires is one witness that a node died, and etcd itself can be the one that
failed (a stalled WAL disk, a SIGSTOPped or overloaded server: every lease expires at once).
Each agent serves one unary gRPC method, `elastic.Probe/Alive`, on the address it publishes in
its `NodeIdentity`; the leader asks it, with a short deadline, before it removes a node whose
lease expired (elastic/roles/leader_suspects.py). The answer is a small JSON object:
`{"node_id", "incarnation", "alive"}`, where `alive` says that the node's agent still runs its
workers (none exited, none stopped). No answer within the deadline (a hung node, a dead one, a
partitioned one) or `alive: false` means the node is lost.

No etcd, no token: the probe tells nothing but "this node incarnation still runs", and the
server binds `bind_host()` (127.0.0.1 unless $ELASTIC_HOST says otherwise).

    server = ProbeServer(lambda: {"node_id": "node0", "incarnation": 0, "alive": True}).start()
    answer = probe(server.address, deadline_s=0.5)   # ProbeAnswer, or None: no answer
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc

from .netaddr import bind_host

log = logging.getLogger(__name__)

SERVICE = "elastic.Probe"
METHOD = f"/{SERVICE}/Alive"
PROBE_DEADLINE_S = 0.5
"""How long the leader waits for a suspect's answer: the most a real hang's detection grows by."""


@dataclass(frozen=True, kw_only=True)
class ProbeAnswer:
    """What a node's agent said when probed."""

    node_id: str
    """The member id that answered."""
    incarnation: int
    """Its incarnation: an answer from another incarnation does not vouch for this one."""
    alive: bool
    """Whether its workers all still run (none exited, none stopped)."""


class ProbeServer:
    """An agent's side: answers `elastic.Probe/Alive` with what `answer()` returns (None: refuse,
    as a partitioned node would not be reached)."""

    def __init__(self, answer: Callable[[], dict[str, Any] | None], *, host: str | None = None) -> None:
        self._answer = answer
        self._host = host or bind_host()
        self._server: grpc.Server | None = None
        self.address = ""
        """`host:port` once started."""

    def _alive(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        answer = self._answer()
        if answer is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "not reachable")
        return json.dumps(answer).encode()

    def start(self) -> ProbeServer:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="probe"))
        handler = grpc.unary_unary_rpc_method_handler(self._alive)  # raw bytes both ways
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Alive": handler}),))
        port = server.add_insecure_port(f"{self._host}:0")
        server.start()
        self._server, self.address = server, f"{self._host}:{port}"
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None)
            self._server = None


def probe(address: str, *, deadline_s: float = PROBE_DEADLINE_S) -> ProbeAnswer | None:
    """Ask the agent at `address` whether it lives; None when it did not answer within
    `deadline_s` (or refused, or the address has no port: an agent that serves no probe)."""
    if not address or address.endswith(":0"):
        return None
    try:
        with grpc.insecure_channel(address) as channel:
            call = channel.unary_unary(METHOD)
            raw = call(b"", timeout=deadline_s, wait_for_ready=False)
        body = json.loads(raw)
        return ProbeAnswer(node_id=str(body["node_id"]), incarnation=int(body["incarnation"]),
                           alive=bool(body["alive"]))
    except grpc.RpcError as exc:
        log.debug("probe of %s: %s", address, exc.code())
        return None
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("probe of %s: malformed answer: %s", address, exc)
        return None
