"""The process groups of the generations a trainer has left.

A left group may have an abandoned operation pending, and destroying a gloo group with one
pending blocks the destroying thread until the group's timeout: so a left group is kept until it
is closed (its connections end and whatever was pending on it fails: elastic/parallel/groups.py,
`close`), once a step of a later generation has committed, since every worker of that generation
has then left the older ones, or when the trainer shuts down. A closed group is then let go, on
the closing thread, and its threads (gloo's TCP loop and work threads, three a group) end with
it; before 2026-12-06 every left group was kept for good, and a worker's threads grew by about a
dozen a generation. A group whose close failed (`ParallelGroups.close` says so) is kept.
"""

from __future__ import annotations

import threading

import torch

from elastic.engine.device import bind
from elastic.parallel.groups import ParallelGroups


class Graveyard:
    """The groups of past generations, in the order they were left: those not yet closed, and
    those being closed or whose close failed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._left: list[ParallelGroups] = []
        """Buried since the last `close_left`."""
        self._kept: list[ParallelGroups] = []
        """Handed to a closing thread and not closed yet, or whose close failed."""

    def bury(self, *groups: ParallelGroups) -> None:
        """Keep `groups` (left, or handed over from a replaced trainer) until they are closed."""
        with self._lock:
            self._left += groups

    def buried(self) -> list[ParallelGroups]:
        """Every group kept here (a closed one is no longer kept)."""
        with self._lock:
            return [*self._kept, *self._left]

    def close_left(self, device: torch.device) -> None:
        """Close the groups buried since the last call, on a thread of their own, and let go of
        each one closed: a step of the current generation committed, so every worker of it has
        left them."""
        with self._lock:
            if not self._left:
                return
            left, self._left = self._left, []
            self._kept += left

        def close() -> None:
            bind(device)
            for groups in left:
                if groups.close():
                    with self._lock:  # by identity: two generations' groups may compare equal
                        self._kept = [g for g in self._kept if g is not groups]
            left.clear()  # the last reference of a closed group may be this one: it ends here

        threading.Thread(target=close, name="close-retired-groups", daemon=True).start()
