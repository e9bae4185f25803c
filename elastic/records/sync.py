"""What a halted generation's workers report (`SyncReport`, folded a node a key at
`sync/<g>/<node>/all`: elastic/records/node_sync.py) and
the leader's decision of the job's last step (`COMMIT` / `ABORT`, at `decisions/<g>/<s>`).

How a step commits: the failure-free step path touches etcd once per step (the `progress` put,
off the critical path): every worker commits a step when the step's world all-reduce (the vote:
gradient norm, loss, ok and halt flags) completes. Generation changes go through `halt/`, `sync/`
and the next `plan/<g>` (see elastic/roles/leader.py); only the job's last step is decided
through etcd (`ready/`, `decisions/`), so that no worker finishes the job while another replays
its last step. Every key is listed in elastic/coordinator/schema.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from elastic.coordinator.jsonrecord import JsonRecord
from elastic.records.generation import Vote
from elastic.records.partial import PartialReport

COMMIT = "commit"
"""The leader's decision at `decisions/<g>/<s>`: every worker commits the job's last step."""
ABORT = "abort"
"""The leader's decision at `decisions/<g>/<s>`: no worker commits the job's last step in generation g."""


@dataclass(frozen=True, kw_only=True)
class SyncReport(JsonRecord):
    """What a worker of a halted generation holds, for the leader to pick the resume step."""

    committed: int | None
    """Steps the worker has committed (the index of its next step); None when it never joined
    the generation (its reconfiguration into it failed), so its step says nothing of it."""
    pending: int | None
    """A step whose vote this worker joined but did not see complete (its reduced gradients
    are kept until the next generation says commit or drop); None otherwise."""
    last_vote: Vote | None
    """The vote of its last committed step (None before the first commit of the job)."""
    node: int
    """Its plan node."""
    local_rank: int
    """Its index inside the node."""
    partial: PartialReport | None = None
    """Gradient sums it kept of step `committed` (its pipeline finished that step's
    microbatches before the step was abandoned); None if none."""
    moments: list[tuple[int, int, int, int, int]] | None = None
    """With the optimizer sharded (issue 55): for each shard it holds, (layer, tp_rank, lo, hi,
    total): the elements [lo, hi) of the flattened shard (`total` elements) whose AdamW moments it
    has now, whichever generation's repair last ran; None when not sharded. What the leader judges
    a lost node's slices by (leader_replan.py `moments_without_holder`): a generation cut short
    before its repair leaves its new owners without them."""
