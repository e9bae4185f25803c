"""Failed checkpoint saves (a full or failing checkpoint disk): the `checkpoint-failures/` keys.

A worker whose background save fails (ENOSPC or any OSError) keeps training: the failed step
leaves no marker, so it never counts as a complete checkpoint and a fallback takes the last
complete one. The worker reports each failed save once: an event (`checkpoint-failed`, shown by
`elastic events`) and one put of its own key `checkpoint-failures/<node>/<local_rank>/<incarnation>`,
a `SaveFailures` record that counts them and keeps the last one (a node's next incarnation
starts a key of its own, so no count is lost). `elastic status` sums the keys
(`checkpoint_failures`) and the metrics serve the count (`elastic_checkpoint_save_failures_total`).
"""

from __future__ import annotations

from dataclasses import dataclass

from elastic.coordinator.jsonrecord import JsonRecord
from elastic.coordinator.keys import JobKeys


@dataclass(frozen=True, kw_only=True)
class SaveFailures(JsonRecord):
    """The failed checkpoint saves of one worker so far."""

    node: int
    """Plan node of the worker."""
    local_rank: int
    """Local rank of the worker on its node."""
    incarnation: int
    """Incarnation of its node."""
    count: int
    """Failed saves so far (each one counted once)."""
    last_step: int
    """Step of the last failed save."""
    last_reason: str
    """Why the last save failed (the OSError's message, e.g. `[Errno 28] No space left on device`)."""
    last_at: float
    """Wall time the last failure was seen (Unix seconds)."""


def save_failures_prefix(keys: JobKeys) -> str:
    """The prefix of every worker's `SaveFailures`."""
    return keys.prefix("checkpoint-failures")


def save_failures_key(keys: JobKeys, node: int, local_rank: int, incarnation: int) -> str:
    """The key of the `SaveFailures` of worker (node, local_rank) of one node incarnation."""
    return keys.key("checkpoint-failures", node, local_rank, incarnation)
