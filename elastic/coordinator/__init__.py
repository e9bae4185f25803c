"""The etcd v3 control plane: membership, failure detection, election, generations, Store, torchrun.

Modules, one concern each: `etcd_server` (a private etcd for launchers and tests), `client`
(connection settings, restart-proof client), `keys` (the key layout), `watch` (reconnecting
prefix watch), `lease`, `membership`, `monitor` (local worker death -> report), `election`,
`generations` (plans by compare-and-swap, committed step), `store` (c10d Store), `access`
(job token), `rendezvous` (torchrun handler), `events` (event log) and `coordinator` (facade).
"""

from .access import JobAccessError, admit
from .client import EtcdConfig, connect
from .coordinator import Coordinator, CoordinatorConfig
from .election import LeaderElection, current_leader
from .etcd_server import EtcdServer
from .generations import CommittedStep, Generation, GenerationConflict, Generations
from .keys import JobKeys
from .membership import MemberEvent, Membership, MembershipConfig, NodeIdentity
from .monitor import WorkerMonitor, watch_workers
from .store import EtcdStore

__all__ = [
    "CommittedStep",
    "Coordinator",
    "CoordinatorConfig",
    "EtcdConfig",
    "EtcdServer",
    "EtcdStore",
    "Generation",
    "GenerationConflict",
    "Generations",
    "JobAccessError",
    "JobKeys",
    "LeaderElection",
    "MemberEvent",
    "Membership",
    "MembershipConfig",
    "NodeIdentity",
    "WorkerMonitor",
    "admit",
    "connect",
    "current_leader",
    "watch_workers",
]
