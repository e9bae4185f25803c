"""Static launcher: a fixed plan's N simulated nodes x G worker processes on this machine, with
no failure handling (`elastic run --static`; the elastic launcher is launcher.py).

`launch` hosts the rendezvous store (a TCPStore on 127.0.0.1; the store is a parameter so an
etcd-backed one can take its place), writes the job spec, starts one worker subprocess per
(node, local rank) (elastic/roles/static_worker.py), relays rank 0's progress to its own stdout,
and watches every worker. It stops every worker it started when the job ends, when any worker
fails (naming that worker and its exit code) or when it is interrupted.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import IO, TYPE_CHECKING

from elastic.records.job import DEVICE_BASE_ENV, JobSpec
from elastic.records.summary import RunSummary, collect_summary
from elastic.roles.launch_errors import WorkerFailed
from elastic.roles.zygote_client import WarmProcess, start_process, warm_parent

if TYPE_CHECKING:
    import torch.distributed as dist

POLL_S = 0.05
"""How often a launcher looks at its processes."""
STOP_GRACE_S = 5.0
"""How long a stopped process may take to exit before it is killed."""


def device_env(node: int, gpus_per_node: int) -> dict[str, str]:
    """The environment that gives `node`'s workers accelerators of their own on a host that runs
    several simulated nodes: node * gpus_per_node onwards (elastic/engine/device.py)."""
    return {DEVICE_BASE_ENV: str(node * gpus_per_node)}


@dataclass
class _Worker:
    node: int
    local_rank: int
    proc: subprocess.Popen[bytes] | WarmProcess
    log: IO[bytes]
    log_path: Path


def host_store(*, timeout_s: float) -> tuple[dist.TCPStore, int]:
    """A TCPStore server on 127.0.0.1 at a free port, and that port."""
    import torch.distributed as dist  # here: the elastic launcher starts without torch (zygote.py)

    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
    )
    return store, store.port


def log_tail(path: Path, lines: int = 25) -> str:
    """The last `lines` lines of the log at `path` (for an error message)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _stop(workers: list[_Worker]) -> None:
    """Stop every still-running worker by PID: SIGTERM, then SIGKILL after a grace period."""
    for w in workers:
        if w.proc.poll() is None:
            w.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for w in workers:
        remaining = max(0.0, deadline - time.monotonic())
        try:
            w.proc.wait(timeout=remaining)
        except subprocess.TimeoutExpired:
            w.proc.kill()
            w.proc.wait()
    for w in workers:
        w.log.close()


def launch(spec: JobSpec, *, quiet: bool = False, timeout_s: float | None = None) -> RunSummary:
    """Run `spec` to completion on local worker processes and return its summary.

    Raises WorkerFailed if a worker exits non-zero, TimeoutError past `timeout_s`.
    """
    run_dir = Path(spec.run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    spec_path = run_dir / "job.json"
    spec.save(spec_path)
    for stale in [spec.result_path, *(spec.stage_state_path(s) for s in range(spec.plan.num_layers))]:
        stale.unlink(missing_ok=True)
    zygote = warm_parent(log=run_dir / "logs" / "zygote.log")  # the workers' warm parent (zygote.py)
    store, port = host_store(timeout_s=spec.collective_timeout_s)
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(spec.threads_per_worker)
    workers: list[_Worker] = []
    start = time.monotonic()
    try:
        for node in sorted(spec.plan.nodes):
            for local_rank in range(spec.plan.gpus_per_node):
                log_path = spec.log_path(node, local_rank)
                log = open(log_path, "wb")  # noqa: SIM115 - closed in _stop
                is_rank0 = spec.plan.locate(node) == (0, 0) and local_rank == 0
                args = ["--spec", str(spec_path), "--node", str(node), "--local-rank", str(local_rank),
                        "--store-port", str(port)]
                proc = start_process("elastic.roles.static_worker", args, zygote=zygote,
                                     env={**env, **device_env(node, spec.plan.gpus_per_node)},
                                     stdout=None if (is_rank0 and not quiet) else log, stderr=log, warn=_warn)
                workers.append(_Worker(node, local_rank, proc, log, log_path))
        _watch(workers, start=start, timeout_s=timeout_s)
    finally:
        _stop(workers)
        del store
        if zygote is not None:
            zygote.close()
    return collect_summary(spec)


def _warn(what: str) -> None:
    print(f"elastic run: {what}", file=sys.stderr, flush=True)


def _watch(workers: list[_Worker], *, start: float, timeout_s: float | None) -> None:
    pending = list(workers)
    while pending:
        for w in list(pending):
            code = w.proc.poll()
            if code is None:
                continue
            if code != 0:
                raise WorkerFailed(
                    f"worker {w.local_rank} of node {w.node} (pid {w.proc.pid}) exited with code {code}; "
                    f"stopped all other workers. Last lines of {w.log_path}:\n{log_tail(w.log_path)}"
                )
            pending.remove(w)
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            raise TimeoutError(f"job did not finish within {timeout_s:.0f} s; stopped all workers")
        time.sleep(POLL_S)
