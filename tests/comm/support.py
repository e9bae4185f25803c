"""Real gloo communicators of several ranks, as threads of this process (one HashStore)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elastic.comm import Communicator, Recorder, open_communicator


def on_threads(n: int, fn: Callable[[int], Any], *, timeout_s: float = 60) -> list[Any]:
    """fn(0) .. fn(n-1) in threads named rank0 .. rank<n-1>; their results (or raised exceptions)."""
    out: list[Any] = [None] * n

    def run(r: int) -> None:
        try:
            out[r] = fn(r)
        except Exception as exc:
            out[r] = exc

    threads = [threading.Thread(target=run, args=(r,), name=f"rank{r}", daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    return out


def gloo_comms(
    n: int, *, name: str = "g1/world", timeout_s: float = 20, recorders: Sequence[Recorder] | None = None,
    store: dist.Store | None = None,
) -> list[Communicator]:
    """One communicator `name` of `n` ranks (rank r's is element r), recording into `recorders[r]`."""
    store = store or dist.HashStore()

    def make(r: int) -> Communicator:
        return open_communicator(dist.PrefixStore(name, store), name=name, members=list(range(n)), rank=r,
                                 backend="gloo", device=torch.device("cpu"), timeout=timedelta(seconds=timeout_s),
                                 recorder=None if recorders is None else recorders[r])

    comms = on_threads(n, make)
    bad = [c for c in comms if not isinstance(c, Communicator)]
    assert not bad, bad
    return comms
