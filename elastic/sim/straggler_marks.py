"""When the runtime would mark a slow node, and clear its mark, as the simulation times it.

The runtime (elastic/planning/stragglers.py) marks a node after a number of slow steps and
clears the mark after as many fast ones; the leader then re-splits (elastic/roles/leader_decisions.py).
Here that delay is `RecoveryCosts.straggler_detect_steps` steps at the pace the run has when the
node's speed changes (or when training resumes, if it is recovering then), counted in seconds at
that pace: a later change of pace does not move it. A re-plan restarts the counts of the nodes
it keeps (the count pauses while nothing trains, and the simulation does not resume it: an
overestimate of at most that many steps), and a node still marked in the new plan is re-split
for after `straggler_window_steps` steps (the runtime's busy seconds restart with each
generation, and its leader waits for a full window of them).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field


@dataclass
class Marks:
    """The marked nodes and the mark changes to come."""

    detect_steps: int
    """Steps from a change of speed to the change of mark."""
    window_steps: int
    """Steps from a re-plan to the re-split for nodes still marked."""
    threshold: float
    """Factors below it are never marked."""
    marked: set[int] = field(default_factory=set)
    """Nodes the runtime has marked."""
    due: dict[int, tuple[float, bool]] = field(default_factory=dict)
    """node -> (when, True: marked then / False: its mark cleared then)."""
    review_at: float | None = None
    """After a re-plan: when the leader re-splits for the nodes still marked."""

    def next_due(self) -> float | None:
        """The earliest time at which the leader has something new to act on."""
        times = [when for when, _ in self.due.values()]
        if self.review_at is not None:
            times.append(self.review_at)
        return min(times, default=None)

    def apply(self, t: float) -> None:
        """Every mark change due at or before `t` takes effect."""
        for node, (when, mark) in list(self.due.items()):
            if when <= t:
                (self.marked.add if mark else self.marked.discard)(node)
                del self.due[node]
        if self.review_at is not None and self.review_at <= t:
            self.review_at = None

    def slowed(self, node: int, factor: float, *, start_s: float, step_s: float) -> None:
        """`node`, in the plan, now runs `factor` times slower; training runs (or resumes at
        `start_s`) at `step_s` a step."""
        if factor < self.threshold:
            self.due.pop(node, None)
        elif node in self.marked:  # slow again before its mark cleared: it stays marked
            self.due.pop(node, None)
            self.review_at = start_s + self.window_steps * step_s
        else:
            self.due[node] = (start_s + self.detect_steps * step_s, True)

    def recovered(self, node: int, *, start_s: float, step_s: float) -> None:
        """`node`, in the plan, is back at full speed."""
        if node in self.marked:
            self.due[node] = (start_s + self.detect_steps * step_s, False)
        else:
            self.due.pop(node, None)  # not marked yet: it never will be

    def drop(self, node: int) -> None:
        """`node` left the plan (failed, or replaced by a spare): its history goes with it."""
        self.marked.discard(node)
        self.due.pop(node, None)

    def replanned(self, nodes: Collection[int], factors: Mapping[int, float], *, start_s: float,
                  step_s: float) -> None:
        """A new plan over `nodes` starts training at `start_s` at `step_s` a step (module doc)."""
        members = set(nodes)
        self.marked &= members
        self.due = {}
        self.review_at = None
        # Only a slow or a marked node gets a due entry: the others need no visit.
        for node in sorted(members.intersection(factors) | self.marked):
            slow = factors.get(node, 1.0) >= self.threshold
            if slow and node not in self.marked:
                self.due[node] = (start_s + self.detect_steps * step_s, True)
            elif not slow and node in self.marked:
                self.due[node] = (start_s + self.detect_steps * step_s, False)
        if any(factors.get(node, 1.0) >= self.threshold for node in self.marked):
            self.review_at = start_s + self.window_steps * step_s
