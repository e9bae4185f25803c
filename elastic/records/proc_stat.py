"""A process's state as /proc tells it (Linux): its state letter (running, sleeping, stopped,
zombie, ...) and the CPU time of its main thread. The agent's stopped-worker check and the
throttle (throttle.py) read them."""

from __future__ import annotations


def process_state(pid: int) -> str | None:
    """The state letter of a process in /proc/<pid>/stat (R running, S sleeping, T stopped, Z
    zombie, ...); None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data[data.rindex(b")") + 2 :].split()[0].decode()


def state_and_cpu(pid: int) -> tuple[str, float] | None:
    """(state letter, CPU seconds of its main thread) of a process, from /proc; None when gone.
    The main thread is where a worker computes; its schedstat counts nanoseconds (the process's
    stat counts 10 ms ticks, too coarse to compare processes tick by tick)."""
    state = process_state(pid)
    if state is None:
        return None
    try:
        with open(f"/proc/{pid}/schedstat", "rb") as f:
            ran_ns = int(f.read().split()[0])
    except (OSError, IndexError, ValueError):
        return None
    return state, ran_ns / 1e9
