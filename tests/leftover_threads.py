"""The threads that a module of in-process gloo groups may leave behind, and a wait for them to end.

A retired generation's threads end on their own: its waiter (elastic/parallel/abort.py) and its
exchange (elastic/parallel/exchange.py) once idle for a few seconds, and gloo's threads with the
last reference to their group. One that never ends is a leak a worker pays once per generation:
a gloo group's TCP loop thread lives as long as anything references one of its works (a leaked
loop polls its sockets; in one pytest session of the background lane they piled up to 772
threads, up to 335 runnable at once, and starved the live lane's jobs, 2026-12-06).
"""

from __future__ import annotations

import gc
import os
import threading
import time
from collections import Counter
from typing import Any

NATIVE = ("gloo_tcp_loop", "pt_gloo_runloop")
"""Kernel names of gloo's threads: a group's TCP loop, and its work threads."""
PYTHON = ("abortable-wait", "tree-exchange")
"""The runtime's own threads of a generation."""


def generation_threads() -> Counter[str]:
    """How many threads of each watched kind this process runs now."""
    counts: Counter[str] = Counter(t.name for t in threading.enumerate() if t.name in PYTHON)
    tasks = f"/proc/{os.getpid()}/task"
    for task in os.listdir(tasks) if os.path.isdir(tasks) else ():
        try:
            with open(f"{tasks}/{task}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if name in NATIVE:
            counts[name] += 1
    return counts


def settle_s() -> float:
    """How long the threads of a generation that just ended may take to go: their idle exits, and
    3 s more. Imported here, not at the top, so that a session of pure units does not import torch."""
    from elastic.parallel.abort import WAITER_IDLE_EXIT_S
    from elastic.parallel.exchange import IDLE_EXIT_S

    return max(WAITER_IDLE_EXIT_S, IDLE_EXIT_S) + 3.0


def left_behind(before: Counter[str], *, within_s: float, kinds: tuple[str, ...] = NATIVE + PYTHON) -> Counter[str]:
    """The watched threads of `kinds` beyond `before` that are still there after up to `within_s`
    (collecting reference cycles, which may hold a group); empty once they all ended."""
    deadline = time.monotonic() + within_s
    while True:
        gc.collect()
        extra = Counter({k: n for k, n in (generation_threads() - before).items() if k in kinds})
        if not extra or time.monotonic() > deadline:
            return extra
        time.sleep(0.1)


class ModuleThreads:
    """The check of tests/conftest.py: the watched threads when a module's first test is set up,
    against those once its last test is torn down (failing that teardown when some are left)."""

    def __init__(self) -> None:
        self.module: Any = None
        self.before: Counter[str] = Counter()

    def setup(self, item: Any) -> None:
        module = getattr(item, "module", None)
        if module is not self.module:
            self.module, self.before = module, generation_threads()

    def teardown(self, item: Any, nextitem: Any) -> None:
        """gloo's threads only: the runtime's own end on their own once idle (and hold nothing
        meanwhile), so a module need not wait for them; one that held a group would keep that
        group's threads, and fail here."""
        if nextitem is not None and getattr(nextitem, "module", None) is self.module:
            return  # not the module's last test
        if not any(k in NATIVE for k in generation_threads() - self.before):
            return  # the common case: no wait, no collection
        within = settle_s()
        left = left_behind(self.before, within_s=within, kinds=NATIVE)
        assert not left, f"gloo threads left behind {within:.0f} s after the module's last test: {dict(left)}"
