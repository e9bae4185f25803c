"""The recording group: what one worker posts on its communicators, in posting order, per lane.

A `Recorder` is handed to a worker's communicators (`Communicator(recorder=...)`); each of them
then logs every operation as it is posted: a communicator's creation (with its members), a
group of point-to-point operations (`grouped`: coalesced into one NCCL group) or an ungrouped
one, a collective, every wait on a posted operation, an abort and a shutdown. The threads of a
worker that post or wait are its *lanes* (the training thread, a gradient exchange's thread);
two lanes hand work to each other through `signal` / `await_` events, so a checker knows that
one lane's post comes after another lane's wait. `elastic.comm.nccl_model.check` replays the
logs of every worker under NCCL's rules.

A lane is named after its thread, or explicitly (`lane_as`): a waiter thread that waits on
behalf of the training thread records in the training thread's lane.

Recording is for tests and for diagnosing a hang; a communicator without a recorder pays one
`is None` check per operation.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

_local = threading.local()


def current_lane() -> str:
    """The lane the calling thread records in: its `lane_as` name, else its thread's name."""
    lane: str | None = getattr(_local, "lane", None)
    return lane if lane is not None else threading.current_thread().name


@contextlib.contextmanager
def lane_as(lane: str) -> Iterator[None]:
    """Record the calling thread's events in `lane` for the duration of the block."""
    before = getattr(_local, "lane", None)
    _local.lane = lane
    try:
        yield
    finally:
        _local.lane = before


@dataclass(frozen=True, kw_only=True)
class Op:
    """One operation posted on a communicator."""

    id: int
    """Unique within the recorder: what a wait names."""
    kind: str
    """"send", "recv", or a collective ("all_reduce", "all_gather", "reduce_scatter", "barrier")."""
    peer: int | None = None
    """Peer's rank in the communicator (point-to-point only)."""
    nbytes: int = 0
    """Bytes the operation moves (a collective: the input's bytes)."""
    tag: int = 0
    """The tag the caller gave (NCCL ignores tags: a matched pair with different tags moves the
    wrong data, which the checker reports)."""

    @property
    def p2p(self) -> bool:
        return self.kind in ("send", "recv")

    def __str__(self) -> str:
        if self.p2p:
            return f"{self.kind}(peer {self.peer}, {self.nbytes} B, tag {self.tag})"
        return f"{self.kind}({self.nbytes} B)"


@dataclass(frozen=True, kw_only=True)
class Event:
    """One entry of a worker's log."""

    lane: str
    """The thread (or the lane it records in) that did it."""
    kind: str
    """"create", "post", "wait", "signal", "await", "abort" or "shutdown"."""
    comm: str | None = None
    """The communicator's name (unique per generation and member set, the same on every member)."""
    ops: tuple[Op, ...] = ()
    """A post's operations."""
    grouped: bool = False
    """A post whose operations form one NCCL group (coalesced)."""
    ids: tuple[int, ...] = ()
    """A wait's operations."""
    abandoned: bool = False
    """A wait the caller gave up on (the generation was aborted): it does not block."""
    members: tuple[int, ...] = ()
    """A creation's members: each member's world rank, by communicator rank."""
    name: str | None = None
    """A signal's or await's name."""
    rank: int | None = None
    """A creation's: the recording worker's own rank in the communicator."""
    eager: bool = False
    """A creation's: the communicator is connected at once (NCCL's eager connect), so an
    ungrouped point-to-point operation runs on its own queue; False: on a two-rank communicator
    of the pair, created lazily at the pair's first such operation."""

    def __str__(self) -> str:
        if self.kind == "post":
            ops = ", ".join(map(str, self.ops))
            return f"{self.comm}: {'group' if self.grouped else 'post'}[{ops}]"
        if self.kind == "wait":
            return f"wait{list(self.ids)}{' (abandoned)' if self.abandoned else ''}"
        if self.kind in ("signal", "await"):
            return f"{self.kind} {self.name}"
        return f"{self.kind} {self.comm}"


@dataclass
class Recorder:
    """The log of one worker (world rank `rank` of its first generation; events name their
    communicators, whose creation events give each member's rank)."""

    rank: int
    """Who this is (for messages)."""
    events: list[Event] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _ids: Iterator[int] = field(default_factory=lambda: itertools.count(1), repr=False)

    def next_id(self) -> int:
        with self._lock:
            return next(self._ids)

    def add(self, kind: str, **fields: object) -> None:
        """Append one event in the calling lane."""
        event = Event(lane=current_lane(), kind=kind, **fields)  # type: ignore[arg-type]
        with self._lock:
            self.events.append(event)

    def create(self, comm: str, members: Sequence[int], rank: int, *, eager: bool = False) -> None:
        self.add("create", comm=comm, members=tuple(members), rank=rank, eager=eager)

    def post(self, comm: str, ops: Sequence[Op], *, grouped: bool) -> None:
        self.add("post", comm=comm, ops=tuple(ops), grouped=grouped)

    def wait(self, ids: Sequence[int], *, abandoned: bool = False) -> None:
        self.add("wait", ids=tuple(ids), abandoned=abandoned)

    def signal(self, name: str) -> None:
        """The calling lane has reached `name` (another lane may `await_` it)."""
        self.add("signal", name=name)

    def await_(self, name: str) -> None:
        """The calling lane goes on only once some lane signalled `name`."""
        self.add("await", name=name)

    def snapshot(self) -> list[Event]:
        with self._lock:
            return list(self.events)
