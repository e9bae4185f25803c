"""`elastic run --shard-optimizer on` through failures on real processes (issue 55): tiny, 4 nodes
as 4 one-stage pipelines at f = 1, so each layer's moments are 2 slices of 2 owners each
(nodes 0 and 2 own slice 1, nodes 1 and 3 slice 2: `templates.optim_slices`).

- Node 3 SIGKILLed at step 9: the survivors re-slice (3 pipelines: one slice, every holder an
  owner) from the live owners, and the run ends bit for bit as the unsharded run without a failure.
- Nodes 2 and 3 killed at step 9, one owner of each slice: the same.
- Nodes 0 and 2 killed, both owners of slice 1: the leader says which slice is lost and, with
  no checkpoint (the sharded optimizer does not write them yet), the job ends with that error.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.faults.cli_runs import CliResult, run_cli, same_bits

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEPS = 12
RUN = [sys.executable, "-m", "elastic.cli", "run", "--model", "tiny", "--nodes", "4", "--fault-tolerance", "1",
       "--global-batch", "8", "--microbatch", "1", "--steps", str(STEPS), "--device", "cpu", "--lease-ttl", "30",
       "--checkpoint-every", "0"]


def _kills(*nodes: int) -> list[str]:
    return [arg for n in nodes for arg in ("--inject", f"kill:node={n},step=9")]


@pytest.fixture(scope="module")
def unsharded(tmp_path_factory: pytest.TempPathFactory) -> CliResult:
    return run_cli([*RUN, "--shard-optimizer", "off"], tmp_path_factory.mktemp("off"), committed=STEPS, lost=[],
                   timeout=150)


@pytest.mark.parametrize("killed", [(3,), (2, 3)])
def test_sharded_run_recovers_bit_for_bit(unsharded: CliResult, tmp_path: Path, killed: tuple[int, ...]) -> None:
    got = run_cli([*RUN, "--shard-optimizer", "on", *_kills(*killed)], tmp_path, committed=STEPS,
                  lost=[list(killed)], timeout=150)
    assert "optimizer sharded" in got[2].splitlines()[0]
    same_bits(got, unsharded, f"sharded, nodes {killed} killed")


def test_losing_every_owner_of_a_slice_names_it(tmp_path: Path) -> None:
    proc = subprocess.run([*RUN, "--shard-optimizer", "on", *_kills(0, 2), "--run-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=150)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "layer 0, optimizer slice 1 of 2: every owner lost (nodes 0, 2)" in proc.stdout + proc.stderr


def test_checkpoints_are_refused_with_a_sharded_optimizer(tmp_path: Path) -> None:
    cmd = [*RUN[:-2], "--checkpoint-every", "4", "--shard-optimizer", "on", "--run-dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "does not write checkpoints yet" in proc.stderr, proc.stderr[-2000:]
