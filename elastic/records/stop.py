"""A whole-job stop that saves: the request in etcd, and how its outcome reads.

`elastic run`'s first Ctrl-C or SIGTERM, or `elastic drain --all`, writes one `StopRequest` at
the job's `stop` key (create-only: the first request stands). The leader meets it at the next
step boundary: it writes a boundary halt of the current generation g (the workers vote it into
their next step and stop after committing it), waits for every live worker's sync report and,
when they all committed the same S steps, rewrites `halt/<g>` with `stop_step` S
(`HaltRecord.stop_step`). No generation follows: each worker writes its checkpoint of step S,
waits until it is on disk, reports itself done ("stopped") and exits 0, and so do the agents.
A job's node that is preempted (SIGTERM to its agent) is still a drain of that node only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

from elastic.coordinator.etcd_api import EtcdClient
from elastic.coordinator.generations import Generations
from elastic.coordinator.jsonrecord import JsonRecord
from elastic.coordinator.keys import JobKeys, RunKeys
from elastic.records.generation import GenerationRecord, HaltRecord
from templates.plan import Plan

By = Literal["sigint", "sigterm", "cli"]
BY_WORDS: dict[str, str] = {"sigint": "Ctrl-C (SIGINT)", "sigterm": "SIGTERM", "cli": "elastic drain --all"}
"""Who asked for a stop (`By`), in words."""
STOPPED = "stopped"
"""The value of a worker's `done/<node>/<local_rank>` key once its checkpoint of the stop is on disk."""


def stop_key(keys: JobKeys) -> str:
    """The job's `stop` key."""
    return keys.key("stop")


@dataclass(frozen=True, kw_only=True)
class StopRequest(JsonRecord):
    """The request that the whole job stop at its next step boundary with a checkpoint there."""

    by: By
    """Who asked: "sigint" (the launcher's first Ctrl-C), "sigterm" (its first SIGTERM) or "cli"
    (`elastic drain --all`)."""
    requested_at: float
    """Wall time of the request."""

    def words(self) -> str:
        """Who asked, in words: `Ctrl-C (SIGINT)`, `SIGTERM`, `elastic drain --all`."""
        return BY_WORDS[self.by]


def submit_stop(client: EtcdClient, keys: JobKeys, by: By) -> tuple[StopRequest, bool]:
    """Write a stop request unless one stands; (the standing request, whether it is ours)."""
    key = stop_key(keys)
    ours = StopRequest(by=by, requested_at=time.time())
    txn = client.transactions
    ok, _ = client.transaction(compare=[txn.create(key) == 0], success=[txn.put(key, ours.to_json())], failure=[])
    if ok:
        return ours, True
    standing = read_stop(client, keys)
    return (standing if standing is not None else ours), False


def read_stop(client: EtcdClient, keys: JobKeys) -> StopRequest | None:
    """The job's stop request (one key read), None while there is none."""
    value, _ = client.get(stop_key(keys))
    return None if value is None else StopRequest.from_json(value)


@dataclass(frozen=True, kw_only=True)
class StopPoint:
    """Where a stopping job stops: the leader wrote `stop_step` into its current generation's halt."""

    generation: int
    """The job's last generation."""
    step: int
    """Steps every worker of it committed: the step of the stop's checkpoint."""
    plan: Plan
    """Its plan (whose every worker reports done once its checkpoint shards are on disk)."""


def read_stop_point(client: EtcdClient, keys: JobKeys) -> StopPoint | None:
    """The job's stop point (three key reads), None while the leader has not decided one."""
    gen = Generations(client, keys).current()
    if gen is None:
        return None
    value, _ = client.get(RunKeys(keys).halt(gen.number))
    halt = None if value is None else HaltRecord.from_json(value)
    if halt is None or halt.stop_step is None:
        return None
    return StopPoint(generation=gen.number, step=halt.stop_step, plan=GenerationRecord.from_json(gen.plan).plan)


def workers_not_done(client: EtcdClient, keys: JobKeys, plan: Plan) -> list[tuple[int, int]]:
    """(node, local_rank) of the workers of `plan` without a `done/` key yet."""
    rk = RunKeys(keys)
    done = set()
    for _, meta in client.get_prefix(rk.done, keys_only=True):
        node, local_rank = meta.key.decode()[len(rk.done) :].split("/")[:2]
        done.add((int(node), int(local_rank)))
    return [(n, r) for n in sorted(plan.nodes) for r in range(plan.gpus_per_node) if (n, r) not in done]
