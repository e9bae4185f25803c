"""Several real writer processes into one step, and a writer SIGKILLed in the middle of a write."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from elastic.engine.checkpoint.files import CheckpointError, marker_path, shard_stem, step_dir
from elastic.engine.checkpoint.load import latest_complete, load_shards
from tests.checkpoint.shards import assert_shards_equal, make_shards
from tests.processes import stop_pids

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

LAYERS, TP = 3, 2
ALL = [(layer, t) for layer in range(LAYERS) for t in range(TP)]
REPO = Path(__file__).resolve().parents[2]


def spawn(directory: Path, saves: list[dict[str, Any]]) -> subprocess.Popen[str]:
    spec = {"dir": str(directory), "num_layers": LAYERS, "tp": TP, "saves": saves}
    return subprocess.Popen(
        [sys.executable, "-m", "tests.checkpoint.writer_proc", json.dumps(spec)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_three_processes_write_one_step_together(tmp_path: Path) -> None:
    parts = [ALL[0:2], ALL[2:3], ALL[3:6]]
    procs = []
    try:
        for i, keys in enumerate(parts):
            saves = [{"step": 10, "keys": keys, "numel": 4096}]
            if i == 1:  # the slow writer: step 10 stays incomplete until it is done
                saves.insert(0, {"step": 9, "keys": ALL, "numel": 4096})
            procs.append(spawn(tmp_path, saves))
        for p in procs:
            assert p.wait(timeout=100) == 0
    finally:
        stop_pids([p.pid for p in procs])
    assert latest_complete(tmp_path, num_layers=LAYERS, tp_degree=TP) == 10
    assert_shards_equal(load_shards(tmp_path, 10, ALL), make_shards(ALL, step=10, numel=4096))
    assert_shards_equal(load_shards(tmp_path, 9, ALL), make_shards(ALL, step=9, numel=4096))


def _wait_for_data(directory: Path, step: int, key: tuple[int, int], deadline: float) -> Path:
    """The data directory of `key` once its writer has started putting bytes in it."""
    stem = shard_stem(key) + "."
    while time.monotonic() < deadline:
        d = step_dir(directory, step)
        if d.is_dir():
            for entry in d.iterdir():
                if entry.name.startswith(stem) and entry.is_dir() and any(entry.iterdir()):
                    return entry
        time.sleep(0.001)
    raise AssertionError(f"the writer never started writing {key} of step {step}")


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_sigkill_mid_write_leaves_the_previous_step_as_latest(tmp_path: Path) -> None:
    last = ALL[-1]
    saves = [
        {"step": 1, "keys": ALL, "numel": 2048},
        {"step": 2, "keys": ALL[:-1], "numel": 2048},
        {"step": 2, "keys": [last], "numel": 1 << 23},  # ~ 100 MiB: the kill lands inside it
    ]
    proc = spawn(tmp_path, saves)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "saved 1"
        assert proc.stdout.readline().strip() == "saved 2"
        partial = _wait_for_data(tmp_path, 2, last, time.monotonic() + 60)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        stop_pids([proc.pid])
    assert partial.exists(), "the killed writer left its partial data"
    assert not marker_path(tmp_path, 2, last).exists(), "the kill landed after the commit"

    assert latest_complete(tmp_path, num_layers=LAYERS, tp_degree=TP) == 1
    assert_shards_equal(load_shards(tmp_path, 1, ALL), make_shards(ALL, step=1, numel=2048))
    with pytest.raises(CheckpointError, match=r"step 2 .* lacks committed shards \(layer 2, tp 1\)"):
        load_shards(tmp_path, 2, ALL)
    # the other shards of step 2 were committed before the kill and stay readable
    assert_shards_equal(load_shards(tmp_path, 2, ALL[:-1]), make_shards(ALL[:-1], step=2, numel=2048))

    # a new writer (the job after its fallback) completes step 2 over the debris
    redo = spawn(tmp_path, [{"step": 2, "keys": [last], "numel": 2048}])
    try:
        assert redo.wait(timeout=100) == 0
    finally:
        stop_pids([redo.pid])
    assert latest_complete(tmp_path, num_layers=LAYERS, tp_degree=TP) == 2
    assert not partial.exists(), "the superseded partial data was removed"
    assert_shards_equal(load_shards(tmp_path, 2, ALL), make_shards(ALL, step=2, numel=2048))
