"""The process groups of the generations a trainer has left.

They are never destroyed: an abandoned operation may be pending on them, and destroying a gloo
group with one pending blocks the destroying thread until the group's timeout. They are closed
(their connections end: elastic/parallel/groups.py, `close`) once a step of a later generation
has committed, since every worker of that generation has then left the older ones, or when the
trainer shuts down.
"""

from __future__ import annotations

import threading

import torch

from elastic.engine.device import bind
from elastic.parallel.groups import ParallelGroups


class Graveyard:
    """The groups of past generations, in the order they were left, and how many are closed."""

    def __init__(self) -> None:
        self._groups: list[ParallelGroups] = []
        self._closed = 0
        """How many entries (the oldest) are closed."""

    def bury(self, *groups: ParallelGroups) -> None:
        """Keep `groups` (left, or handed over from a replaced trainer) until they are closed."""
        self._groups += groups

    def buried(self) -> list[ParallelGroups]:
        """Every group kept here, closed or not."""
        return list(self._groups)

    def close_left(self, device: torch.device) -> None:
        """Close the groups buried since the last call, on a thread of their own: a step of the
        current generation committed, so every worker of it has left them."""
        if self._closed == len(self._groups):
            return
        left, self._closed = self._groups[self._closed:], len(self._groups)

        def close() -> None:
            bind(device)
            for groups in left:
                groups.close()

        threading.Thread(target=close, name="close-retired-groups", daemon=True).start()
