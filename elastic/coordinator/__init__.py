"""The etcd v3 control plane: membership, failure detection, election, generations, Store, torchrun.

Modules, one concern each: `etcd_server` (a private etcd for launchers and tests), `client`
(connection settings, restart-proof client), `credentials` (etcd credentials from the
environment, a first read that names what is wrong), `keys` (the key layout), `watch` (reconnecting
prefix watch), `lease`, `membership`, `monitor` (local worker death -> report), `election`,
`generations` (plans by compare-and-swap), `store` (c10d Store), `access`
(job token), `rendezvous` (torchrun handler), `events` (event log) and `jsonrecord` (the JSON
form and schema version of every record the runtime stores).
There is no facade object: each role holds the pieces it uses (see `elastic/roles/agent.py`).
"""

from typing import TYPE_CHECKING, Any

from .access import JobAccessError, admit
from .client import EtcdConfig, connect
from .election import LeaderElection, current_leader
from .etcd_server import EtcdServer
from .generations import Generation, GenerationConflict, Generations
from .keys import JobKeys
from .membership import MemberEvent, Membership, MembershipConfig, NodeIdentity
from .monitor import WorkerMonitor, watch_workers

if TYPE_CHECKING:
    from .store import EtcdStore

# These import torch (seconds); member processes and the CLI that only need etcd skip that.
_LAZY = {"EtcdStore": "store"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
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
