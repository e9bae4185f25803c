"""`elastic run --virtual-stages 2` on real processes (issue 53): tiny with 6 blocks (8 planning
layers), 4 nodes, node 3 SIGKILLed at step 9.

- 2 pipelines of 2 nodes (f = 1), interleaved: recovery without restart ends bit for bit as the
  plain 1F1B run through the same failure (the step's summation tree does not depend on the
  schedule), and as the interleaved run without the failure.
- One pipeline of 4 nodes (f = 0), interleaved: the lost node's layers have no replica, so the
  job falls back to its checkpoint (written by an interleaved layout, restored into a 3-node one)
  and still ends bit for bit the same.
- TP 2 without sequence parallelism: interleaved with scatter/gather through the failure ends
  bit for bit as plain 1F1B sending whole tensors without a failure.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.faults.cli_runs import CliResult, run_cli, same_bits
from tests.faults.runs import check_same_training, max_rel_diff, run_elastic

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

STEPS = 10
RUN = [sys.executable, "-m", "elastic.cli", "run", "--model", "tiny", "--n-layer", "6", "--nodes", "4",
       "--global-batch", "8", "--microbatch", "1", "--steps", str(STEPS), "--device", "cpu", "--lease-ttl", "30"]
"""A long lease: a failure is seen by the node's own monitor (tests/faults/test_recompute_run.py)."""
KILL = ("--inject", "kill:node=3,step=9")
TWO_BY_TWO = ("--fault-tolerance", "1", "--device-memory-gib", "0.04", "--checkpoint-every", "0")
"""The budget at which the planner lays 2 pipelines of 2 nodes, with room for 2 chunks' in-flight
activations per node (the default budget lays 4 one-node pipelines)."""
ONE_BY_FOUR = ("--device-memory-gib", "0.025", "--checkpoint-every", "4")
"""The budget at which it lays one pipeline of 4 nodes, 2 chunks each; checkpoints for the fallback."""
TP2 = ("--gpus-per-node", "2", "--no-sequence-parallel", "--fault-tolerance", "1", "--device-memory-gib", "0.022",
       "--checkpoint-every", "0")
"""TP 2 halves each device's share: at this budget the planner lays 2 pipelines of 2 nodes again."""

Result = CliResult


def _run(run_dir: Path, *extra: str, committed: int = STEPS) -> Result:
    return run_cli([*RUN, *extra], run_dir, committed=committed, lost=[[3]] if KILL[1] in extra else [], timeout=200)


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Result:
    """2 x 2 pipelines, plain 1F1B, node 3 killed at step 9."""
    return _run(tmp_path_factory.mktemp("plain"), *TWO_BY_TWO, "--virtual-stages", "1", *KILL)


_same = same_bits


def test_two_interleaved_pipelines_recover_bit_for_bit(plain: Result, tmp_path: Path) -> None:
    assert "interleaved" not in plain[2].splitlines()[0]
    failed = _run(tmp_path / "kill", *TWO_BY_TWO, "--virtual-stages", "2", *KILL)
    assert "2-stage x 4 mb + 2-stage x 4 mb, interleaved v=2" in failed[2].splitlines()[0], failed[2][:300]
    _same(failed, plain, "interleaved, node 3 killed")
    _same(_run(tmp_path / "clean", *TWO_BY_TWO, "--virtual-stages", "2"), plain, "interleaved, no failure")


def test_one_interleaved_pipeline_falls_back_to_its_checkpoint(plain: Result, tmp_path: Path) -> None:
    got = _run(tmp_path, *ONE_BY_FOUR, "--virtual-stages", "2", *KILL)
    assert "4-stage x 8 mb, interleaved v=2" in got[2].splitlines()[0], got[2][:300]
    assert got[0]["recoveries"][0]["restore_checkpoint"] is not None
    _same(got, plain, "one interleaved pipeline, checkpoint fallback")


def test_tensor_parallel_scatter_gather_through_a_failure(tmp_path: Path) -> None:
    whole = _run(tmp_path / "whole", *TP2, "--virtual-stages", "1", "--no-scatter-gather")
    split = _run(tmp_path / "split", *TP2, "--virtual-stages", "2", *KILL)
    assert "interleaved v=2, scatter/gather" in split[2].splitlines()[0], split[2][:300]
    _same(split, whole, "TP 2: interleaved with scatter/gather vs plain with whole tensors")


def test_partial_replay_with_interleaved_pipelines(tmp_path: Path) -> None:
    """2 pipelines x 2 stages x 2 chunks (tiny's 6 layers), node 2 SIGKILLed in step 8: the
    pipeline that lost no node keeps its sums (one per chunk's layers), the step's rest is
    replayed, and the state equals the failure-free run bit for bit."""
    reference = run_elastic(tmp_path / "clean", nodes=4, pipelines=2, virtual_stages=2, steps=12)
    summary, state = run_elastic(tmp_path / "kill", nodes=4, pipelines=2, virtual_stages=2, steps=12,
                                 inject=("kill:node=2,step=8",))
    check_same_training(summary, state, reference, steps=12)
    assert max_rel_diff(state, reference[1]) == 0.0
    (rec,) = summary.recoveries
    assert rec["lost_nodes"] == [2] and rec["restore_checkpoint"] is None
    print(f"kept {rec['kept_microbatches']}, replayed {rec['replayed_fraction']}")
    # As in test_partial_replay.py: the fault lands in step 8's schedule (microbatches 0-1 kept)
    # or, rarely, in its vote (step 9 replayed whole).
    assert (rec["kept_microbatches"], rec["replayed_fraction"]) in (([0, 1], 0.5), ([], 1.0)), rec


# Back from interleaved to plain is `soak`: the default test resumes plain into interleaved.
@pytest.mark.parametrize(("before", "after"), [(1, 2), pytest.param(2, 1, marks=pytest.mark.soak)])
def test_resume_between_plain_and_interleaved(plain: Result, tmp_path: Path, before: int, after: int) -> None:
    """A checkpoint of a v = `before` run resumed at v = `after` ends as the uninterrupted plain
    run, bit for bit: checkpoints hold layers, whoever held them in whichever chunk."""
    first = tmp_path / "first"
    _run_partly(first, 6, *TWO_BY_TWO[:-2], "--checkpoint-every", "3", "--virtual-stages", str(before))
    got = _run(tmp_path / "resumed", *TWO_BY_TWO, "--virtual-stages", str(after), "--resume", str(first),
               committed=STEPS - 6)
    if after > 1:
        assert "interleaved v=2" in got[2].splitlines()[0], got[2][:300]
    assert got[0]["losses"][-1] == plain[0]["losses"][-1]
    differ = [name for name in got[1] if not torch.equal(got[1][name], plain[1][name])]
    assert not differ, f"v={before} -> v={after}: final parameters differ in {differ}"


def _run_partly(run_dir: Path, steps: int, *extra: str) -> None:
    cmd = [*RUN[:RUN.index("--steps")], "--steps", str(steps), *RUN[RUN.index("--steps") + 2:],
           "--no-report", "--run-dir", str(run_dir), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, f"{extra}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
