"""Peak-memory reports from the engine's worker processes, for bench/gpu_check.py.

The engine writes no figure of its memory, and its workers are started by `elastic run` (the
launcher, or an agent under the control plane), not by the bench. Python imports
`sitecustomize` at start-up from the first `sys.path` entry that has one, and the workers inherit
the environment: bench/gpu_check.py puts this folder first on PYTHONPATH and names a folder in
$ELASTIC_BENCH_PEAK_DIR. In a worker (`python -m elastic.roles.static_worker` or
`elastic.roles.elastic_worker`), a daemon thread then appends to `peak-<pid>.jsonl` in that folder,
every POLL_S seconds and only when a value grew, one line: `t` (Unix seconds), `allocated` and
`reserved` (torch.cuda.max_memory_allocated / max_memory_reserved of the busiest device, or None
while CUDA is not initialised), `device_used` (the largest seen of that device's total less its free
memory: every process's context, allocator pool and communicator buffers on it) and `rss` (the
process's peak resident set, bytes). The reader
(bench/gpu_check.py) takes the last line written before the run's last commit: the peak of
training, without the final-state export after it. Other processes (launcher, agents, leader)
write nothing. This module never imports torch: it reads it only once the worker has.

Without $ELASTIC_BENCH_PEAK_DIR it does nothing but load the `sitecustomize` it shadows, if any.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import resource
import sys
import threading
import time
from pathlib import Path
from typing import Any

ENV = "ELASTIC_BENCH_PEAK_DIR"
"""The folder the reports go to; unset: no reports."""
POLL_S = 0.25
"""Seconds between two readings."""
WORKER_MODULES = frozenset({"static_worker", "elastic_worker"})
"""Modules of elastic/roles/ whose processes report."""


def _is_worker() -> bool:
    """Whether this process runs one of WORKER_MODULES (`python -m` has set sys.argv[0] to its file)."""
    script = Path(sys.argv[0]) if sys.argv and sys.argv[0] else Path()
    return script.parent.name == "roles" and script.stem in WORKER_MODULES


def _reading() -> dict[str, Any]:
    """This process's peaks now: CUDA allocated and reserved (busiest device), peak RSS."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    torch = sys.modules.get("torch")
    allocated = reserved = used = None
    if torch is not None and hasattr(torch, "cuda") and torch.cuda.is_initialized():
        # Statistics only: reading a device's allocator stats creates no context on it.
        per_device = [
            (torch.cuda.max_memory_allocated(i), torch.cuda.max_memory_reserved(i), i)
            for i in range(torch.cuda.device_count())
        ]
        allocated, reserved, busiest = max(per_device)
        if allocated:  # the worker's device: its context exists, and the query makes no other
            free, total = torch.cuda.mem_get_info(busiest)
            used = total - free
    return {"allocated": allocated, "reserved": reserved, "device_used": used, "rss": rss}


def _watch(folder: Path) -> None:
    time.sleep(POLL_S)  # let `python -m` set sys.argv
    if not _is_worker():
        return
    path = folder / f"peak-{os.getpid()}.jsonl"
    last: dict[str, Any] = {}
    while True:
        try:
            now = _reading()
        except Exception:  # torch half-imported, or torn down at exit: read again next time
            now = last
        used = [u for u in (now.get("device_used"), last.get("device_used")) if u is not None]
        now["device_used"] = max(used) if used else None  # the largest seen, as the other peaks
        if now != last:
            with open(path, "a") as f:
                f.write(json.dumps({"t": time.time(), **now, "argv0": sys.argv[0]}) + "\n")
            last = now
        time.sleep(POLL_S)


def _load_shadowed() -> None:
    """Run the `sitecustomize` that this one hides (a distribution's, further on sys.path)."""
    here = Path(__file__).resolve().parent
    others = [p for p in sys.path if Path(p or ".").resolve() != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", others)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


if os.environ.get(ENV):
    threading.Thread(target=_watch, args=(Path(os.environ[ENV]),), name="bench-peak-memory", daemon=True).start()
_load_shadowed()
