"""The runtime's real code path under the model of NCCL: 200 generated jobs of real Trainers
(tests/comm/cluster.py: threads, gloo, every communicator recording), each through a step, an
evaluation, a full-state gather, a failure with or without partial replay, a re-plan with shards
moved between survivors and to spares, kept sums moved with their layers, and two more steps,
each job with a recompute mode (none, selective or full: full reposts a block's tensor-parallel
all-reduces inside the backward), and about a third with the optimizer sharded (each step's
gather of parameters, generation 2's re-slicing of moments, the checkpoint writers' gather of
moment slices; their end state read through the writers).
Every job's logs replay under NCCL's rules without a deadlock or any other problem, every job
ends with the state of a one-process run bit for bit (the step's summation tree makes every plan,
failure and replay the same step), and the generated set covers every pattern issue 31 lists
(checked, so a change of the generator cannot silently drop one). The jobs run in subprocesses
(tests/comm/batch.py), whose gloo threads end with them, two at a time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.comm.patterns import WANTED

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
CASES = 200
BATCHES = 4
SEEN: Counter[str] = Counter()


CONCURRENT = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2
"""Batches run at once: each is one process whose threads share one interpreter (about one core),
so two use this machine's two cores; the jobs have no deadline tighter than their 60 s timeouts.
Under pytest-xdist one, as the other core runs the live tests (tests/conftest.py)."""


BATCH_TIMEOUT_S = 540
"""Wall-clock limit of one batch (a batch takes 60-80 s on this machine)."""


def _run_batch(batch: int, out: Path) -> subprocess.CompletedProcess[str]:
    count = CASES // BATCHES
    cmd = [sys.executable, "-m", "tests.comm.batch", "--first", str(batch * count), "--count", str(count),
           "--out", str(out)]
    try:
        return subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                              text=True, timeout=BATCH_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:  # the jobs it ran and where it stood, for the report
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else str(exc.stderr or "")
        return subprocess.CompletedProcess(cmd, -9, "", f"timed out after {BATCH_TIMEOUT_S} s\n{err}")


@pytest.fixture(scope="module")
def batches(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, tuple[Future[Any], Path]]]:
    """Every batch, started at the module's first test, CONCURRENT at a time; each test waits for its own."""
    root = tmp_path_factory.mktemp("real-paths")
    with ThreadPoolExecutor(max_workers=CONCURRENT) as pool:
        started = {b: (pool.submit(_run_batch, b, root / f"jobs{b}.jsonl"), root / f"jobs{b}.jsonl")
                   for b in range(BATCHES)}
        yield started


@pytest.mark.parametrize("batch", range(BATCHES))
def test_generated_jobs_never_deadlock_under_nccls_rules(
    batch: int, batches: dict[int, tuple[Future[Any], Path]]
) -> None:
    future, out = batches[batch]
    done = future.result()
    jobs = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    assert done.returncode == 0 and len(jobs) == CASES // BATCHES, (
        f"batch exited {done.returncode} after {len(jobs)} of {CASES // BATCHES} jobs:\n{done.stderr[-12000:]}")
    for job in jobs:
        assert not job["errors"], f"{job['case']}: {job['errors']}"
        assert job["steps"] == [3], f"{job['case']}: steps committed {job['steps']}"
        assert not job["nccl"], f"{job['case']}\n{job['nccl'][0]}"
        assert not job["differences"], f"{job['case']}: not the one-process run's state: {job['differences']}"
        SEEN.update(job["features"])


def test_the_generated_jobs_cover_every_pattern() -> None:
    """After the batches (pytest keeps file order): what they covered."""
    if not SEEN:
        pytest.skip("run with the batches above: it checks what they covered")
    missing = sorted(WANTED - set(SEEN))
    assert not missing, f"patterns no generated job exercised: {missing}; seen {dict(SEEN)}"
