"""A model of NCCL that replays recorded logs (elastic/comm/record.py) and finds deadlocks.

Every worker's log is split into lanes (its threads), each a sequence of events in program
order. The model plays all lanes of all workers against each other under NCCL's rules:

- A communicator runs each rank's operations in posting order: only the *head* unit of a
  rank's queue on a communicator is active (a unit is one group of operations, or one
  ungrouped operation); it leaves the queue when all its operations are complete, so a group's
  operations complete together.
- An active send completes together with the peer's matching receive, and only when that
  receive is active too: no message is buffered. Tags are ignored: the n-th send from A to B
  meets B's n-th receive from A (a pair whose tags or sizes differ is reported: it would move
  the wrong bytes).
- An ungrouped point-to-point operation on a communicator connected eagerly (its creation says
  `eager`: NCCL's eager connect, the runtime's default) is one unit on that communicator's
  queue, behind everything posted before it. On one connected lazily it runs on a two-rank
  communicator of its own, created at the pair's first ungrouped operation as a blocking
  rendezvous: the posting lane waits until the peer reaches its own first ungrouped operation
  with it.
- One lane posts to a communicator: a communicator posted from two lanes of a worker is
  reported (torch keeps its coalescing state per group, NCCL its group depth per thread: two
  threads posting one communicator can nest one's operations into the other's group).
- A collective completes when every member's head unit is that collective; members whose
  heads are different collectives are reported.
- Creating a communicator is a blocking rendezvous of all its members.
- A wait blocks its lane until the operations' units are complete (conservative: on NCCL the
  host goes on and the stream waits, and every later operation of that stream waits with it).
  A wait the caller abandoned (its generation was aborted) does not block.
- `await` blocks until the same worker's `signal` of that name.
- An abort ends every pending operation of that rank on the communicator and its pairs;
  posting on an aborted communicator is reported. A shutdown waits until nothing is pending,
  and a communicator shut down (not aborted) while operations of its are pending, never waited
  for or abandoned, is reported: torch's shutdown waits for them, which an abandoned step's
  operations never end.
  Both take effect where they stand in the worker's log (its real order across lanes: a wait is
  logged once it returned), only after every event logged before them has run; a post logged
  after an abort is one made on an aborted communicator.

The model stops when nothing can move. Every lane at its end and nothing pending (outside
aborted communicators) is a pass; otherwise `Report` names each stuck lane, the event it is
stuck at and what the peers' heads hold.

What it assumes, and what it does not cover:
- One interleaving of each worker's threads: the order the log has. A worker's lanes hand work
  to each other only through the logged signals, waits and the log's own order (for an abort or
  a shutdown); a race that another interleaving of the same threads would lose is not explored.
- Streams as lanes: a lane's operations are issued in its order, and a wait blocks the lane
  until they are complete (stricter than NCCL, whose wait blocks the stream, not the host).
  Kernels of one stream on different communicators, and compute, are not modelled.
- Sizes: a pair of different sizes is reported, not played out; NCCL's channels, chunking,
  buffering of small messages and timeouts are not modelled (no operation is buffered).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from elastic.comm.record import Event, Op

Worker = Hashable
"""A log's key: whatever names a worker (the same worker across generations)."""


@dataclass
class _Unit:
    ops: list[Op]
    done: set[int] = field(default_factory=set)

    def complete(self) -> bool:
        return len(self.done) == len(self.ops)

    def active(self) -> list[Op]:
        return [o for o in self.ops if o.id not in self.done]


@dataclass(frozen=True)
class _Queue:
    """A rank's queue on a communicator (`pair`: the lazily created two-rank one of an
    ungrouped point-to-point pair of that communicator)."""

    worker: Worker
    comm: str
    pair: tuple[int, int] | None = None

    def __str__(self) -> str:
        return self.comm if self.pair is None else f"{self.comm} pair {self.pair}"


@dataclass(frozen=True, kw_only=True)
class Stuck:
    """A lane that cannot go on."""

    worker: Worker
    lane: str
    event: Event
    why: str

    def __str__(self) -> str:
        return f"worker {self.worker} lane {self.lane!r} stuck at {self.event}: {self.why}"


@dataclass(frozen=True, kw_only=True)
class Report:
    """What the model found."""

    stuck: tuple[Stuck, ...]
    """Lanes that cannot go on: a deadlock (or a peer that never posts)."""
    problems: tuple[str, ...]
    """Everything else that breaks NCCL's rules: mismatched pairs or collectives, posts on an
    aborted communicator, operations left pending on a live communicator."""
    events: int
    """Events replayed."""

    @property
    def ok(self) -> bool:
        return not self.stuck and not self.problems

    @property
    def deadlock(self) -> bool:
        return bool(self.stuck)

    def describe(self) -> str:
        if self.ok:
            return f"no deadlock, no problem ({self.events} events)"
        lines = ([f"deadlock: {len(self.stuck)} lanes stuck"] if self.stuck else []) + [f"  {s}" for s in self.stuck]
        return "\n".join(lines + [f"problem: {p}" for p in self.problems])


class _Model:
    def __init__(self, logs: Mapping[Any, Sequence[Event]]) -> None:
        self.lanes: dict[tuple[Worker, str], list[Event]] = {}
        self.seq: dict[tuple[Worker, int], int] = {}
        """(worker, id(event)) -> its place in the worker's log."""
        self.ran: set[tuple[Worker, int]] = set()
        self.prefix: dict[Worker, int] = {}
        """Worker -> how many of its first logged events have all run."""
        self.ended_at: dict[tuple[Worker, str], int] = {}
        """(worker, communicator) -> place of its first abort or shutdown in the worker's log."""
        for worker, events in logs.items():
            for i, e in enumerate(events):
                self.lanes.setdefault((worker, e.lane), []).append(e)
                self.seq[(worker, id(e))] = i
                if e.kind in ("abort", "shutdown") and e.comm is not None:
                    self.ended_at.setdefault((worker, e.comm), i)
        self.pc = {lane: 0 for lane in self.lanes}
        self.eager = {e.comm for events in logs.values() for e in events if e.kind == "create" and e.eager}
        """Communicators connected at creation: an ungrouped operation joins their own queue."""
        self.retired_pending: set[tuple[Worker, str]] = set()
        self.members: dict[str, dict[int, Worker]] = {}
        self.sizes: dict[str, int] = {}
        for worker, events in logs.items():
            for e in events:
                if e.kind == "create":
                    assert e.comm is not None and e.rank is not None
                    self.members.setdefault(e.comm, {})[e.rank] = worker
                    self.sizes[e.comm] = len(e.members)
        self.rank_of = {(c, w): r for c, ranks in self.members.items() for r, w in ranks.items()}
        self.queues: dict[_Queue, deque[_Unit]] = {}
        self.unit_of: dict[tuple[Worker, int], _Unit] = {}
        self.arrived: dict[tuple[str, tuple[int, int] | None], set[Worker]] = {}
        self.created: set[tuple[Worker, str, tuple[int, int] | None]] = set()
        self.signals: set[tuple[Worker, str]] = set()
        self.aborted: set[tuple[Worker, str]] = set()
        self.shut: set[tuple[Worker, str]] = set()
        self.problems: list[str] = []
        self.events = sum(len(v) for v in self.lanes.values())
        self._check_lanes(logs)

    def _check_lanes(self, logs: Mapping[Any, Sequence[Event]]) -> None:
        """Report every communicator a worker posts to from more than one lane (module doc)."""
        posting: dict[tuple[Worker, str], list[str]] = {}
        for worker, events in logs.items():
            for e in events:
                if e.kind == "post" and e.comm is not None:
                    lanes = posting.setdefault((worker, e.comm), [])
                    if e.lane not in lanes:
                        lanes.append(e.lane)
        for (worker, comm), lanes in posting.items():
            if len(lanes) > 1:
                self.problems.append(
                    f"worker {worker}: {comm} is posted from {len(lanes)} lanes {lanes}: torch keeps its coalescing "
                    "state per group and NCCL its group depth per thread, so one thread posts a communicator")

    # ---- lanes ---------------------------------------------------------------------------

    def run(self) -> Report:
        moved = True
        while moved:
            moved = False
            for lane in self.lanes:
                while self._step(lane):
                    moved = True
            moved = self._progress() or moved
        stuck = tuple(self._stuck(lane) for lane in self.lanes if self.pc[lane] < len(self.lanes[lane]))
        if not stuck:
            for q, units in self.queues.items():
                if units and (q.worker, q.comm) not in self.aborted:
                    ops = ", ".join(str(o) for u in units for o in u.active())
                    self.problems.append(f"worker {q.worker}: operations left pending on {q}: {ops} "
                                         "(NCCL's watchdog would time them out)")
        return Report(stuck=stuck, problems=tuple(self.problems), events=self.events)

    def _step(self, lane: tuple[Worker, str]) -> bool:
        """Run the lane's next event if it can run now."""
        events = self.lanes[lane]
        if self.pc[lane] >= len(events):
            return False
        worker = lane[0]
        e = events[self.pc[lane]]
        if e.kind == "create":
            assert e.comm is not None
            if not self._rendezvous(worker, e.comm, None, set(self.members[e.comm].values())):
                return False
        elif e.kind == "post":
            if not self._post(worker, e):
                return False
        elif e.kind == "wait":
            if not e.abandoned and not all(self._done(worker, i) for i in e.ids):
                return False
        elif e.kind == "signal":
            assert e.name is not None
            self.signals.add((worker, e.name))
        elif e.kind == "await":
            assert e.name is not None
            if (worker, e.name) not in self.signals:
                return False
        elif e.kind == "abort":
            assert e.comm is not None
            if not self._all_before_ran(worker, e):
                return False
            self.aborted.add((worker, e.comm))
            for q, units in self.queues.items():
                if q.worker == worker and q.comm == e.comm:
                    for u in units:
                        u.done.update(o.id for o in u.ops)
                    units.clear()
        elif e.kind == "shutdown":
            assert e.comm is not None
            if not self._all_before_ran(worker, e):
                return False
            if (worker, e.comm) not in self.aborted and not self._drained(worker, e.comm):
                return False
            self.shut.add((worker, e.comm))
        else:
            self.problems.append(f"worker {worker}: unknown event {e.kind!r}")
        self.pc[lane] += 1
        self.ran.add((worker, self.seq[(worker, id(e))]))
        return True

    def _all_before_ran(self, worker: Worker, e: Event) -> bool:
        """Whether every event the worker logged before `e` has run."""
        done = self.prefix.get(worker, 0)
        while (worker, done) in self.ran:
            done += 1
        self.prefix[worker] = done
        return done >= self.seq[(worker, id(e))]

    def _drained(self, worker: Worker, comm: str) -> bool:
        """Whether nothing of `worker` is pending on `comm` (its pairs included); the first time
        something is, it is reported: a live communicator retired with work pending (module doc)."""
        pending = [o for q, units in self.queues.items() if q.worker == worker and q.comm == comm
                   for u in units for o in u.active()]
        if pending and (worker, comm) not in self.retired_pending:
            self.retired_pending.add((worker, comm))
            self.problems.append(
                f"worker {worker}: {comm} shut down (not aborted) with operations pending: "
                f"{', '.join(map(str, pending))} (torch's shutdown waits for them: abort it instead)")
        return not pending

    def _rendezvous(self, worker: Worker, comm: str, pair: tuple[int, int] | None, members: set[Worker]) -> bool:
        """Arrive at the creation of `comm` (or its `pair`); True once every member arrived."""
        if (worker, comm, pair) in self.created:
            return True
        arrived = self.arrived.setdefault((comm, pair), set())
        arrived.add(worker)
        if not members <= arrived:
            return False
        for w in members:
            self.created.add((w, comm, pair))
        return True

    def _post(self, worker: Worker, e: Event) -> bool:
        assert e.comm is not None
        ended = self.ended_at.get((worker, e.comm))
        if ended is not None and ended < self.seq[(worker, id(e))]:
            self.problems.append(f"worker {worker}: {e} posted after it aborted or shut the communicator down")
            return True  # nothing is queued
        if e.comm not in self.members or (e.comm, worker) not in self.rank_of:
            self.problems.append(f"worker {worker}: {e} on a communicator it never created")
            return True
        pair = None
        if not e.grouped and len(e.ops) == 1 and e.ops[0].p2p and e.comm not in self.eager:
            me, peer = self.rank_of[(e.comm, worker)], e.ops[0].peer
            assert peer is not None
            pair = (min(me, peer), max(me, peer))
            if not self._rendezvous(worker, e.comm, pair, {self.members[e.comm][r] for r in pair}):
                return False
        unit = _Unit(list(e.ops))
        self.queues.setdefault(_Queue(worker, e.comm, pair), deque()).append(unit)
        for o in e.ops:
            self.unit_of[(worker, o.id)] = unit
        return True

    def _done(self, worker: Worker, op_id: int) -> bool:
        unit = self.unit_of.get((worker, op_id))
        if unit is None:
            self.problems.append(f"worker {worker}: waits on operation {op_id}, which it never posted")
            return True
        return unit.complete()

    # ---- the device side -----------------------------------------------------------------

    def _progress(self) -> bool:
        """Complete every operation that can complete now; whether any did."""
        moved = False
        again = True
        while again:
            again = False
            for q, units in list(self.queues.items()):
                if not units:
                    continue
                head = units[0]
                for op in head.active():
                    if op.id in head.done:
                        continue
                    if (self._match_p2p(q, head, op) if op.p2p else self._match_collective(q, head, op)):
                        again = moved = True
                if head.complete():
                    units.popleft()
                    again = moved = True
        return moved

    def _head(self, q: _Queue) -> _Unit | None:
        units = self.queues.get(q)
        return units[0] if units else None

    def _match_p2p(self, q: _Queue, unit: _Unit, op: Op) -> bool:
        me = self.rank_of[(q.comm, q.worker)]
        assert op.peer is not None
        peer = self.members[q.comm].get(op.peer)
        if peer is None:
            self.problems.append(f"worker {q.worker}: {op} on {q.comm}, which has no rank {op.peer}")
            unit.done.add(op.id)
            return True
        other = self._head(_Queue(peer, q.comm, q.pair))
        if other is None:
            return False
        want = "recv" if op.kind == "send" else "send"
        match = next((o for o in other.active() if o.p2p and o.kind == want and o.peer == me), None)
        if match is None:
            return False
        if match.nbytes != op.nbytes or match.tag != op.tag:
            self.problems.append(
                f"mismatched pair on {q}: worker {q.worker}'s {op} met worker {peer}'s {match} "
                "(NCCL matches by order, not by tag: the wrong bytes would move)"
            )
        unit.done.add(op.id)
        other.done.add(match.id)
        return True

    def _match_collective(self, q: _Queue, unit: _Unit, op: Op) -> bool:
        heads: dict[int, tuple[_Unit, Op]] = {}
        for r, w in self.members[q.comm].items():
            head = self._head(_Queue(w, q.comm, None))
            got = None if head is None else next((o for o in head.active() if not o.p2p), None)
            if head is None or got is None:
                return False
            heads[r] = (head, got)
        kinds = {(o.kind, o.nbytes) for _, o in heads.values()}
        if len(kinds) > 1:
            seen = ", ".join(f"rank {r}: {o}" for r, (_, o) in sorted(heads.items()))
            self.problems.append(f"members of {q.comm} post different collectives at once: {seen}")
        for head, o in heads.values():
            head.done.add(o.id)
        return True

    # ---- the report ----------------------------------------------------------------------

    def _stuck(self, lane: tuple[Worker, str]) -> Stuck:
        worker, name = lane
        e = self.lanes[lane][self.pc[lane]]
        if e.kind == "create":
            assert e.comm is not None
            arrived = self.arrived.get((e.comm, None), set())
            missing = [w for w in self.members.get(e.comm, {}).values() if w not in arrived]
            why = f"creating {e.comm}, a rendezvous of its members; not there: {missing}"
        elif e.kind == "post" and not e.grouped:
            assert e.comm is not None and e.ops[0].peer is not None
            peer = self.members[e.comm][e.ops[0].peer]
            why = (f"its first ungrouped operation with worker {peer} creates their pair communicator of {e.comm}, "
                   f"a rendezvous worker {peer} never joins (it is stuck elsewhere)")
        elif e.kind == "wait":
            why = "; ".join(self._why_pending(worker, i) for i in e.ids if not self._done(worker, i))
        elif e.kind == "await":
            why = f"no lane of worker {worker} signals {e.name!r}"
        elif e.kind == "shutdown":
            why = "operations are still pending on it"
        else:
            why = "cannot run"
        return Stuck(worker=worker, lane=name, event=e, why=why)

    def _why_pending(self, worker: Worker, op_id: int) -> str:
        for q, units in self.queues.items():
            if q.worker != worker:
                continue
            for depth, u in enumerate(units):
                for o in u.ops:
                    if o.id != op_id:
                        continue
                    if depth:
                        return f"{o} on {q} is behind {depth} earlier unit(s) [{self._describe(units[0])}]"
                    return f"{o} on {q} waits for {self._peer_state(q, o)}"
        return f"operation {op_id} is pending"

    def _peer_state(self, q: _Queue, op: Op) -> str:
        if not op.p2p:
            heads = [f"rank {r}: {self._describe(self._head(_Queue(w, q.comm, None)))}"
                     for r, w in sorted(self.members[q.comm].items())]
            return "the members' heads: " + "; ".join(heads)
        assert op.peer is not None
        peer = self.members[q.comm][op.peer]
        return f"worker {peer}, whose head on {_Queue(peer, q.comm, q.pair)} is " \
            f"{self._describe(self._head(_Queue(peer, q.comm, q.pair)))}"

    @staticmethod
    def _describe(unit: _Unit | None) -> str:
        return "empty" if unit is None else "[" + ", ".join(str(o) for o in unit.active()) + "]"


def check(logs: Mapping[Any, Sequence[Event]]) -> Report:
    """Replay every worker's log under NCCL's rules (module doc)."""
    return _Model(logs).run()
