"""The workers of a run: their registration (`WorkerInfo`, folded into `workers/<node>/all` on the
node's lease, elastic/records/node_workers.py) and the plan node numbers behind the etcd member ids `node<k>`.

A node's incarnation counts its (re)starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from elastic.coordinator.etcd_api import EtcdClient
from elastic.coordinator.jsonrecord import JsonRecord
from elastic.coordinator.keys import JobKeys
from elastic.coordinator.membership import read_members


def node_id(node: int) -> str:
    """The etcd member id of plan node `node`."""
    return f"node{node}"


def node_of(member_id: str) -> int:
    """Plan node number of member id `node<k>`; ValueError for another form."""
    if not member_id.startswith("node") or not member_id[4:].isdigit():
        raise ValueError(f"member id {member_id!r} is not of the form node<k>")
    return int(member_id[4:])


def live_nodes(client: EtcdClient, keys: JobKeys) -> dict[int, int]:
    """Plan node -> incarnation of every live member of the job (members of another form skipped)."""
    out = {}
    for member_id, ident in read_members(client, keys)[0].items():
        try:
            out[node_of(member_id)] = ident.incarnation
        except ValueError:
            continue
    return out


@dataclass(frozen=True, kw_only=True)
class WorkerInfo(JsonRecord):
    """A worker's registration, in its node's `workers/<node>/all` (`NodeWorkers`)."""

    pid: int
    """Its process id (the launcher counts restarts of survivors from these)."""
    transfer_address: str
    """host:port of its ShardServer."""
    incarnation: int
    """Incarnation of its node."""
    started: dict[str, float] = field(default_factory=dict)
    """Wall times of its start: spawned (its agent decided), forked (from a warm parent; absent
    for a fresh interpreter), process, main (imports done), registered (elastic/roles/start_phases.py)."""
