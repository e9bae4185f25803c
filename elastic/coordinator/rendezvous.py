"""The torchrun rendezvous handler on etcd v3: `torchrun --rdzv-backend=elastic-etcd`.

    torchrun --nnodes=1:4 --nproc-per-node=G --rdzv-backend=elastic-etcd \\
        --rdzv-endpoint=HOST:PORT --rdzv-id=JOB --rdzv-conf=ttl=5,last_call_timeout=2 -m WORKER

torch's own `etcd`/`etcd-v2` backends speak etcd's v2 API, which etcd 3.6 removed; this one
speaks v3. Its semantics differ from torch's on purpose: torchrun is only the node-local process
supervisor, and the runtime reconfigures the job *in place* when nodes come and go. So

- each torchrun agent registers its node as a member of the job (`members/`, leased; the
  agent keeps the lease alive, so a killed node is lost after `ttl`), after presenting the
  job token (`token=` in rdzv-conf, or $ELASTIC_JOB_TOKEN);
- a *round* seals the nodes that are waiting once at least `min_nodes` are members (after a
  `last_call_timeout` grace for more to arrive, or at once with `max_nodes` waiting); torchrun's
  RANK/WORLD_SIZE describe that round only;
- `num_nodes_waiting()` is always 0, so torchrun never restarts surviving workers because a
  node joined or left: a late node seals a round of its own and the runtime admits it;
- when torchrun restarts the workers of its own node, `next_rendezvous` runs again and the node
  rejoins as a new incarnation (peers see the old one lost and the new one join).

Workers learn their job identity from environment variables the handler sets in the agent
(which workers inherit): ELASTIC_ETCD_ENDPOINT, ELASTIC_JOB, ELASTIC_NODE_ID,
ELASTIC_INCARNATION, ELASTIC_RDZV_ROUND. The handler never shares a TCPStore with workers
(`use_agent_store` is False), so pytorch issue 135712 (a restarted worker re-reading a dead
worker's store address) cannot arise; each round gets a fresh `EtcdStore` prefix.

rdzv-conf keys: token, node_id, devices, ttl, last_call_timeout, timeout (join timeout), user,
password, ca_cert, cert_key, cert_cert. The credentials are better given in the environment
($ELASTIC_ETCD_USER, $ELASTIC_ETCD_PASSWORD, $ELASTIC_ETCD_CA, $ELASTIC_ETCD_CERT,
$ELASTIC_ETCD_KEY; see `client.config_from_env`): rdzv-conf is on torchrun's command line, which
`ps` shows. Either way the handler leaves them in the environment its workers inherit.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from .access import admit
from .client import EtcdConfig, connect
from .credentials import config_from_env, credentials_env
from .keys import JobKeys, check_name
from .membership import Membership, MembershipConfig, NodeIdentity, read_members
from .store import EtcdStore

log = logging.getLogger(__name__)

BACKEND = "elastic-etcd"


class EtcdRendezvousHandler(RendezvousHandler):
    """One torchrun agent's view of the job; see the module docstring for the semantics."""

    def __init__(
        self,
        *,
        etcd: EtcdConfig,
        run_id: str,
        min_nodes: int,
        max_nodes: int,
        node_id: str,
        devices: int = 1,
        token: str | None = None,
        ttl: int = 5,
        last_call_timeout: float = 1.0,
        join_timeout: float = 600.0,
        local_addr: str | None = None,
    ) -> None:
        if not 1 <= min_nodes <= max_nodes:
            raise ValueError(f"need 1 <= min_nodes <= max_nodes, got {min_nodes}:{max_nodes}")
        self.etcd = etcd
        self.keys = JobKeys(run_id)
        self.run_id = run_id
        self.min_nodes = min_nodes
        self.max_nodes = max_nodes
        self.node_id = check_name("node id", node_id)
        self.devices = devices
        self._token = token
        self.membership_config = MembershipConfig(ttl=ttl)
        self.last_call_timeout = last_call_timeout
        self.join_timeout = join_timeout
        self.local_addr = local_addr
        self.client = connect(etcd)
        self.membership: Membership | None = None

    # -- RendezvousHandler -----------------------------------------------------------------

    def get_backend(self) -> str:
        return BACKEND

    def get_run_id(self) -> str:
        return self.run_id

    @property
    def use_agent_store(self) -> bool:
        return False

    def is_closed(self) -> bool:
        return self.client.get(self.keys.key("rdzv-closed"))[0] is not None

    def set_closed(self) -> None:
        self.client.put(self.keys.key("rdzv-closed"), "1")

    def num_nodes_waiting(self) -> int:
        # Joins and losses are handled in place by the runtime: never let torchrun restart survivors.
        return 0

    def shutdown(self) -> bool:
        if self.membership is not None:
            self.membership.leave()
            self.membership = None
        self.client.close()
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        if self.is_closed():
            raise RendezvousClosedError(f"rendezvous of job {self.run_id!r} is closed")
        admit(self.client, self.keys, self._token)  # JobAccessError before anything is written
        incarnation = self._next_incarnation()
        if self.membership is not None:  # torchrun restarted our workers: the old incarnation is gone
            self.membership.leave()
        # ELASTIC_HOST (elastic/coordinator/netaddr.py) is the address peers reach this node at.
        address = f"{os.environ.get('ELASTIC_HOST') or self.local_addr or socket.getfqdn()}:0"
        identity = NodeIdentity(
            node_id=self.node_id, incarnation=incarnation, address=address, devices=self.devices
        )
        self.membership = Membership(self.client, self.keys, identity, config=self.membership_config)
        self.membership.join()
        waiting_key = self.keys.key("rdzv-waiting", self.node_id)
        self.client.put(waiting_key, str(incarnation), lease=self.membership.lease_id)
        round_number, rank, world = self._await_round(incarnation)
        store = EtcdStore(
            self.client,
            self.keys.prefix("rdzv-store", round_number),
            timeout=timedelta(seconds=self.join_timeout),
        )
        bootstrap = RendezvousStoreInfo.build(rank, store, self.local_addr)
        os.environ.update(
            ELASTIC_ETCD_ENDPOINT=self.etcd.endpoint,
            ELASTIC_JOB=self.run_id,
            ELASTIC_NODE_ID=self.node_id,
            ELASTIC_INCARNATION=str(incarnation),
            ELASTIC_RDZV_ROUND=str(round_number),
        )
        os.environ.update(credentials_env(self.etcd))  # rdzv-conf credentials reach the workers too
        log.info("node %s (incarnation %d) joined round %d as %d/%d", self.node_id, incarnation, round_number,
                 rank, world)
        return RendezvousInfo(store, rank, world, bootstrap)

    # -- internals -------------------------------------------------------------------------

    def _next_incarnation(self) -> int:
        key = self.keys.key("rdzv-incarnation", self.node_id)
        txn = self.client.transactions
        while True:
            value, meta = self.client.get(key)
            new = int(value) + 1 if value is not None else 0
            guard = txn.create(key) == 0 if meta is None else txn.mod(key) == meta.mod_revision
            ok, _ = self.client.transaction(compare=[guard], success=[txn.put(key, str(new))], failure=[])
            if ok:
                return new

    def _await_round(self, incarnation: int) -> tuple[int, int, int]:
        """Wait until a sealed round includes (node, incarnation); seal one when it is time."""
        me = [self.node_id, incarnation]
        round_key = self.keys.key("rdzv-round")
        waiting_prefix = self.keys.prefix("rdzv-waiting")
        deadline = time.monotonic() + self.join_timeout
        ready_since: float | None = None
        txn = self.client.transactions
        while time.monotonic() < deadline:
            value, meta = self.client.get(round_key)
            state: dict[str, Any] = json.loads(value) if value is not None else {"round": 0, "nodes": []}
            if me in state["nodes"]:
                return state["round"], state["nodes"].index(me), len(state["nodes"])
            members, _ = read_members(self.client, self.keys)
            waiting = sorted(self.client.get_prefix(waiting_prefix), key=lambda item: item[1].create_revision)
            if len(members) >= self.min_nodes and waiting:
                ready_since = ready_since if ready_since is not None else time.monotonic()
                if len(waiting) >= self.max_nodes or time.monotonic() - ready_since >= self.last_call_timeout:
                    nodes = [[m.key.decode().rsplit("/", 1)[1], int(v)] for v, m in waiting][: self.max_nodes]
                    guard = (
                        txn.create(round_key) == 0
                        if meta is None
                        else txn.mod(round_key) == meta.mod_revision
                    )
                    new_state = json.dumps({"round": state["round"] + 1, "nodes": nodes})
                    ops = [txn.put(round_key, new_state)]
                    ops += [txn.delete(self.keys.key("rdzv-waiting", node)) for node, _ in nodes]
                    self.client.transaction(compare=[guard], success=ops, failure=[])
                    continue
            else:
                ready_since = None
            time.sleep(0.1)
        raise RendezvousTimeoutError(
            f"node {self.node_id} found no rendezvous round of job {self.run_id!r} within {self.join_timeout} s"
        )


def create_handler(params: RendezvousParameters) -> EtcdRendezvousHandler:
    """Build the handler from torchrun's parameters (rdzv-conf values arrive as strings)."""
    if not params.endpoint:
        raise ValueError("--rdzv-endpoint=HOST:PORT[,HOST:PORT...] of etcd is required for the elastic-etcd backend")
    # HOST:PORT or a list of cluster members; a member without a port gets etcd's 2379
    endpoint = ",".join(m if ":" in m else f"{m}:2379" for m in params.endpoint.split(","))
    given = {field: params.get(field) for field in ("user", "password", "ca_cert", "cert_key", "cert_cert")}
    etcd = config_from_env(endpoint, **{field: value for field, value in given.items() if value})
    node_id = params.get("node_id") or f"{socket.gethostname()}-{os.getpid()}"
    return EtcdRendezvousHandler(
        etcd=etcd,
        run_id=params.run_id,
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        node_id=str(node_id),
        devices=params.get_as_int("devices", 1) or 1,
        token=params.get("token") or os.environ.get("ELASTIC_JOB_TOKEN"),
        ttl=params.get_as_int("ttl", 5) or 5,
        last_call_timeout=float(params.get("last_call_timeout", 1.0)),
        join_timeout=float(params.get("join_timeout", params.get("timeout", 600.0))),
        local_addr=params.local_addr,
    )


def handler_factory() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The `torchrun.handlers` entry point: torch registers what this returns under our name."""
    return create_handler


__all__ = ["BACKEND", "EtcdRendezvousHandler", "create_handler", "handler_factory"]
