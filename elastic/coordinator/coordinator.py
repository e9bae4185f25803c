"""`Coordinator`: the one object a node's runtime holds to talk to the control plane.

coord = Coordinator(CoordinatorConfig(etcd=EtcdConfig(endpoint="127.0.0.1:2379"), job="gpt"),
                    NodeIdentity(node_id="n0", incarnation=0, address="10.0.0.1:5000", devices=8))
coord.start()                                   # check token, join, campaign for leader
coord.membership.watch(on_member_event)         # joins and losses
coord.watch_workers(worker_pids)                # local worker death -> lease revoked at once
if coord.election.is_leader():
    coord.generations.publish(plan_json, expected=g, fence=coord.election.leader_compare())
coord.generations.watch(on_generation)          # act only on committed generations
store = coord.store(g)                          # init_process_group(..., store=store)
coord.close()
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType

from .access import admit
from .client import EtcdConfig, connect
from .election import LeaderElection
from .generations import Generations
from .keys import JobKeys
from .membership import Membership, MembershipConfig, NodeIdentity
from .monitor import WorkerMonitor, watch_workers
from .store import EtcdStore


@dataclass(frozen=True, kw_only=True)
class CoordinatorConfig:
    """Everything a node needs to join a job's control plane."""

    etcd: EtcdConfig
    """How to reach etcd."""
    job: str
    """Job id; all keys live under /elastic/<job>/."""
    ttl: int = 5
    """Lease TTL in seconds for membership and leadership."""
    token: str | None = None
    """The job token (shared secret); None for a job without one."""
    store_timeout: float = 300.0
    """Default timeout, in seconds, of blocking Store calls."""


class Coordinator:
    """Membership, failure reporting, leader election, generations and Stores of one node."""

    def __init__(self, config: CoordinatorConfig, identity: NodeIdentity) -> None:
        self.config = config
        self.identity = identity
        self.keys = JobKeys(config.job)
        self.client = connect(config.etcd)
        self.membership = Membership(
            self.client, self.keys, identity, config=MembershipConfig(ttl=config.ttl)
        )
        self.election = LeaderElection(self.client, self.keys, identity.node_id, ttl=config.ttl)
        self.generations = Generations(self.client, self.keys)
        self._monitors: list[WorkerMonitor] = []

    def start(self, *, campaign: bool = True) -> Coordinator:
        """Present the token (JobAccessError if wrong), register, and campaign for leadership."""
        admit(self.client, self.keys, self.config.token)
        self.membership.join()
        if campaign:
            self.election.start()
        return self

    def watch_workers(self, pids: Iterable[int]) -> WorkerMonitor:
        """Report this node failed the moment one of `pids` exits."""
        monitor = watch_workers(self.membership, pids)
        self._monitors.append(monitor)
        return monitor

    def store(self, generation: int) -> EtcdStore:
        """The c10d Store of `generation` (its own key prefix)."""
        return EtcdStore(
            self.client,
            self.keys.store(f"gen-{generation}"),
            timeout=timedelta(seconds=self.config.store_timeout),
        )

    def close(self) -> None:
        """Stop monitors, resign, leave the job (peers see this node go) and close the client."""
        for monitor in self._monitors:
            monitor.stop()
        if self.election.started:
            self.election.resign()
        self.membership.leave()
        self.client.close()

    def __enter__(self) -> Coordinator:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
