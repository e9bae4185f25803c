"""The phases of a node's start, from its agent's start to its last worker's registration.

A worker stamps its own start (`worker_stamps`) into its registration (`WorkerInfo.started`):
when its agent decided to start it, when its process began (a fork of the warm parent, or a
fresh interpreter), when its `main` ran (imports done) and when it registered. The agent folds
its workers' stamps into one `started` event per node incarnation (`start_phases`): the slowest
worker's figure for each phase, so the event says where a slow start spent its time.
"""

from __future__ import annotations

import contextlib
import os
import time

import psutil

from elastic.roles.zygote import FORKED_AT_ENV, SPAWNED_AT_ENV


def worker_stamps(main_at: float) -> dict[str, float]:
    """This process's start stamps (wall times), given when its `main` began; `registered` is now."""
    stamps = {"main": main_at, "registered": time.time()}
    for name, var in (("spawned", SPAWNED_AT_ENV), ("forked", FORKED_AT_ENV)):
        with contextlib.suppress(KeyError, ValueError):
            stamps[name] = float(os.environ[var])
    stamps["process"] = stamps.get("forked", process_start_time())
    return stamps


def process_start_time() -> float:
    """Wall time at which this process began, to the kernel's clock tick (10 ms).

    psutil's `create_time()` adds the process's start (in ticks since boot) to the boot time that
    /proc/stat gives in whole seconds, so it reads early by the boot time's fraction of a second,
    the same for every process of a host (0.32 s on the machine this was found on): every
    `started` event's agent and total figures were that much too long. Here the boot time is
    now less CLOCK_BOOTTIME, which the start's ticks count from."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # starttime, field 22 of proc(5)
        return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME) + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):  # not Linux
        return psutil.Process().create_time()


def start_phases(agent_started: float, workers: list[dict[str, float]]) -> dict[str, float]:
    """Seconds per phase of one node's start (module doc); the slowest worker's for each."""

    def slowest(begin: str, end: str) -> float:
        spans = [w[end] - w[begin] for w in workers if begin in w and end in w]
        return round(max(spans), 3) if spans else 0.0

    spawned = [w["spawned"] for w in workers if "spawned" in w]
    registered = [w["registered"] for w in workers if "registered" in w]
    return {
        "agent_s": round(min(spawned) - agent_started, 3) if spawned else 0.0,
        "process_s": slowest("spawned", "process"),
        "imports_s": slowest("process", "main"),
        "setup_s": slowest("main", "registered"),
        "worker_s": slowest("spawned", "registered"),
        "total_s": round(max(registered) - agent_started, 3) if registered else 0.0,
    }
