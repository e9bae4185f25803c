"""The `stragglers` key: each node's speed factor against its peers and the nodes marked as
stragglers (elastic/planning/stragglers.py), written by world rank 0, which learns every node's
busy time from each step's vote (roles/straggler_reporter.py). `elastic status` shows it; the
`events` log has each mark and its end.

Size: about 80 bytes a node (its factor, its busy seconds and their phases), plus one entry per
marked node. It is written when a mark changes and otherwise at most every `PUT_EVERY_S` seconds
(the leader re-splits on fresh busy times), and no process watches it: at 2,048 nodes that is
about 160 KB a second.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from elastic.coordinator.etcd_api import EtcdClient
from elastic.coordinator.jsonrecord import JsonRecord
from elastic.coordinator.keys import JobKeys
from elastic.planning.stragglers import StragglerConfig

PUT_EVERY_S = 1.0
"""Longest a changed factor waits to be written when no mark changed."""


def stragglers_key(keys: JobKeys) -> str:
    return keys.key("stragglers")


def policy_key(keys: JobKeys) -> str:
    """`elastic stragglers --policy ...`'s settings for a running job (`PolicyOverride`)."""
    return keys.key("straggler-policy")


@dataclass(frozen=True, kw_only=True)
class Mark:
    """A node marked as a straggler."""

    since_step: int
    """The step at which it was marked."""
    since: float
    """Wall time of the mark."""
    factor: float
    """Its smoothed speed factor at the mark."""


@dataclass(frozen=True, kw_only=True)
class StragglerRecord(JsonRecord):
    """What `stragglers` holds (module doc)."""

    step: int
    """The last step taken in."""
    generation: int
    at: float
    """Wall time of the write."""
    policy: str
    threshold: float
    factors: dict[int, float] = field(default_factory=dict)
    """Node -> its smoothed speed factor (its cost per unit of work over its peers' median)."""
    busy: dict[int, float] = field(default_factory=dict)
    """Node -> its busy seconds a step under generation `generation` (median of a full window of
    its steps; nodes without one yet are left out), as Prometheus exports them."""
    marked: dict[int, Mark] = field(default_factory=dict)
    """Node -> its mark, for every node marked now."""
    phases: dict[int, list[float]] = field(default_factory=dict)
    """Node -> [forward, backward, wait] seconds a step under generation `generation`, each the
    median of the same window as `busy` (elastic/parallel/phase_clock.py)."""


def read_stragglers(client: EtcdClient, keys: JobKeys) -> StragglerRecord | None:
    value, _ = client.get(stragglers_key(keys))
    return None if value is None else StragglerRecord.from_json(value)


@dataclass(frozen=True, kw_only=True)
class PolicyOverride(JsonRecord):
    """The straggler settings an operator changed on a running job (`elastic stragglers`); the
    ones left None stay the run's (`elastic run --straggler-*`). World rank 0's reporter and the
    leader read it about once a second, so a change needs no restart. Under 100 bytes."""

    policy: str | None = None
    threshold: float | None = None
    steps: int | None = None
    at: float
    """Wall time of the change."""

    def apply(self, base: StragglerConfig) -> StragglerConfig:
        """`base` with the changed settings (ValueError, one line, if they are not valid)."""
        changed = {k: v for k, v in (("policy", self.policy), ("threshold", self.threshold),
                                     ("steps", self.steps)) if v is not None}
        return dataclasses.replace(base, **changed)  # type: ignore[arg-type]


def read_policy(client: EtcdClient, keys: JobKeys, base: StragglerConfig) -> StragglerConfig:
    """The job's straggler settings now: `base` (the run's) with the operator's changes, if any
    (ValueError, a RecordError included, for a malformed or invalid change)."""
    value, _ = client.get(policy_key(keys))
    return base if value is None else PolicyOverride.from_json(value).apply(base)
