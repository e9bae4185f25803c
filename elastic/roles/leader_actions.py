"""The writes a leader round can ask for, one small frozen record each. The decision functions
(roles/leader_decisions.py) return a round's writes as a tuple of them, in the order the
protocol needs (a halt before the plan that follows it, an answer after its generation), and
roles/leader.py carries them out one by one, fenced by the leader key where it matters."""

from __future__ import annotations

from dataclasses import dataclass, field

from elastic.records.generation import GenerationRecord
from elastic.records.injection_requests import InjectionRequest
from elastic.roles.leader_replan import Fallback


@dataclass(frozen=True, kw_only=True)
class Halt:
    """Write `halt/<g>` (fenced): `abort` (a loss: drop the in-flight step) or at the next step
    boundary (the workers vote it into their next step and stop after committing it)."""

    abort: bool
    reason: str
    lost: list[int] = field(default_factory=list)
    """With `abort`: the lost nodes (the other pipelines finish their microbatches); empty: every pipeline stops."""
    write: bool = True
    """False: a halt at least as strong is there already; the round goes on from it."""


@dataclass(frozen=True, kw_only=True)
class DecideLastStep:
    """Create the decision of (g, the job's last step) (fenced) unless one stands. If "commit"
    stands, the job is done: the leader finishes and the round's other writes are dropped."""

    decision: str


@dataclass(frozen=True, kw_only=True)
class Publish:
    """Publish generation g+1 (a compare-and-swap on g, fenced), with a "generation" event;
    then delete what generation g-1 left. The leader stamps `detected_at`, `synced_at` and
    `published_at` as it writes."""

    record: GenerationRecord


@dataclass(frozen=True, kw_only=True)
class PublishFallback:
    """Publish g+1 from the newest verified checkpoint: the leader searches the checkpoint
    directory (a "checkpoint-skipped" event for each corrupt one), rebuilds the plan over the
    live nodes (leader_replan.fallback_plan) and publishes it; "fatal" when there is none."""

    fallback: Fallback
    members: dict[int, int]
    """Live node -> incarnation (the new plan's incarnations)."""
    lost: list[int]
    joined: list[int]


@dataclass(frozen=True, kw_only=True)
class StopAt:
    """Write `stop_step` into `halt/<g>` (fenced) and a "stopped" event: every worker
    checkpoints `step` and leaves; no generation follows. The leader finishes."""

    step: int
    by: str
    words: str
    """The stop request in words (elastic/records/stop.py)."""


@dataclass(frozen=True, kw_only=True)
class Finish:
    """The leader's work is done (the last step committed, or the job stopped)."""

    why: str


@dataclass(frozen=True, kw_only=True)
class NoteSpare:
    """A "spare" event: a ready newcomer stays a hot spare (once per incarnation)."""

    node: int
    incarnation: int
    generation: int


@dataclass(frozen=True, kw_only=True)
class SpareTaken:
    """A "spare-taken" event: a hot spare takes a lost (or drained) node's stage in `generation`."""

    node: int
    incarnation: int
    lost: list[int]
    generation: int
    drained: list[int] | None = None
    """The drained node whose stage it takes (None: a loss; the event then has no `drained`)."""


@dataclass(frozen=True, kw_only=True)
class Answer:
    """Write a drain request's status (`done` or `refused`) and a "drain" / "drain-refused" event."""

    request: InjectionRequest
    state: str
    detail: str
    generation: int | None = None


@dataclass(frozen=True, kw_only=True)
class AskDrain:
    """Submit a drain request of a straggler (`by` "stragglers", once per incarnation) and a
    "straggler-action" event with every estimate: the drain path carries it out next rounds."""

    node: int
    incarnation: int
    choice: str
    """"spare" (a ready spare takes its stage) or "drop" (the others are re-planned)."""
    factor: float
    estimates: str


Step = Halt | DecideLastStep | Publish | PublishFallback | StopAt | Finish | NoteSpare | SpareTaken | Answer | AskDrain
"""One write (or group of writes) of a round."""
