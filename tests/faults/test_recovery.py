"""The issue's Must-show list: live recovery on real processes, real etcd, real SIGKILL/SIGSTOP.

Every run trains `tiny` for 20 steps on multi-stage pipelines (so shards really move) and is
compared with the failure-free result (one worker, shared with the other fault modules): same losses, same final parameters (max relative difference
<= 1e-5), 20 steps committed, and no survivor's worker restarted (their PIDs are the ones they
registered at the start).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from elastic.records.summary import RunSummary
from elastic.roles.launch_errors import JobFailed
from elastic.roles.zygote import warm_enabled

from .runs import check_same_training, reference_run, run_elastic

pytestmark = [pytest.mark.slow, pytest.mark.timeout(200)]

LONG = 40 if warm_enabled() else 160
"""Steps of the rejoin run: the node restarted at step 3 comes from the warm parent (under a
second) and is in the plan at about step 15 here, with the machine's step time and its start
slowing alike under load; 40 steps also share the failure-free result of other modules. A cold
start (ELASTIC_WARM=0) takes seconds of imports: 160 steps."""

Reference = tuple[RunSummary, dict[str, torch.Tensor]]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """The failure-free result (one worker: the state is plan-independent), shared per session."""
    return reference_run(tmp_path_factory, steps=20)


def survivors_kept_pids(summary: RunSummary, lost: set[int]) -> None:
    for key, pids in summary.worker_pids.items():
        node, _, incarnation = (int(x) for x in key.split("/"))
        if node not in lost:
            assert incarnation == 0 and len(pids) == 1, (key, pids)


@pytest.mark.soak
def test_sigkill_of_one_node(reference: Reference, tmp_path: Path) -> None:
    """Off by default (soak): test_partial_replay.py::test_only_the_broken_pipelines_microbatches_are_replayed[kill]
    runs the same job and fault (4 nodes, 2 pipelines, kill:node=2,step=8) with the same checks."""
    summary, state = run_elastic(tmp_path, nodes=4, pipelines=2, inject=("kill:node=2,step=8",))
    check_same_training(summary, state, reference)
    (rec,) = summary.recoveries
    assert rec["lost_nodes"] == [2] and rec["restore_checkpoint"] is None and rec["bytes_moved"] > 0
    survivors_kept_pids(summary, {2})


@pytest.mark.soak
def test_sigstop_of_one_node(reference: Reference, tmp_path: Path) -> None:
    """Off by default (soak): test_partial_replay.py::test_only_the_broken_pipelines_microbatches_are_replayed[hang]
    hangs node 2 of the same job at step 8 (found by the same lease expiry) with the same checks."""
    summary, state = run_elastic(tmp_path, nodes=4, pipelines=2, inject=("hang:node=3,step=8",))
    check_same_training(summary, state, reference)
    (rec,) = summary.recoveries
    assert rec["lost_nodes"] == [3] and rec["bytes_moved"] > 0
    survivors_kept_pids(summary, {3})


def test_leader_node_killed(reference: Reference, tmp_path: Path) -> None:
    summary, state = run_elastic(tmp_path, nodes=4, pipelines=2, inject=("kill:node=0,step=8",))
    check_same_training(summary, state, reference)
    assert [r["lost_nodes"] for r in summary.recoveries] == [[0]]
    survivors_kept_pids(summary, {0})


def test_two_simultaneous_failures_with_f2(reference: Reference, tmp_path: Path) -> None:
    summary, state = run_elastic(tmp_path, nodes=5, pipelines=3, fault_tolerance=2,
                                 inject=("kill:node=1,step=8", "kill:node=3,step=8"))
    check_same_training(summary, state, reference)
    lost = sorted(n for r in summary.recoveries for n in r["lost_nodes"])
    assert lost == [1, 3] and all(r["restore_checkpoint"] is None for r in summary.recoveries)
    survivors_kept_pids(summary, {1, 3})


def test_second_failure_during_reconfiguration(reference: Reference, tmp_path: Path) -> None:
    summary, state = run_elastic(tmp_path, nodes=5, pipelines=3,
                                 inject=("kill:node=1,step=8", "kill:node=2,when=reconfig"))
    check_same_training(summary, state, reference)
    lost = sorted(n for r in summary.recoveries for n in r["lost_nodes"])
    assert lost == [1, 2] and all(r["restore_checkpoint"] is None for r in summary.recoveries)
    assert not summary.recoveries[-1]["interrupted"] and summary.recoveries[-1]["total_s"] < 60
    survivors_kept_pids(summary, {1, 2})


def test_node_rejoins_later(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    # A restarted node needs about a second to start and join: with 20 tiny steps the job could
    # end first, so this run trains LONG steps, against the LONG-step failure-free result.
    reference = reference_run(tmp_path_factory, steps=LONG)
    summary, state = run_elastic(tmp_path / "rejoin", nodes=4, pipelines=2, steps=LONG,
                                 inject=("kill:node=2,step=2", "rejoin:node=2,step=3"))
    check_same_training(summary, state, reference, steps=LONG)
    assert [r["lost_nodes"] for r in summary.recoveries] == [[2], []]
    assert summary.recoveries[1]["joined_nodes"] == [2] and summary.recoveries[1]["bytes_moved"] > 0
    assert "2/0/1" in summary.worker_pids, "the rejoined node runs a new incarnation"
    survivors_kept_pids(summary, {2})


def test_every_holder_of_a_layer_killed_falls_back_to_the_checkpoint(
    reference: Reference, tmp_path: Path
) -> None:
    # Nodes 0 and 2 are the first stages of both pipelines: layers 0-2 lose every holder.
    # Checkpoints every 2 steps: on a loaded machine the background writers have lagged more
    # than 3 steps behind (a CI run found step 5's incomplete at the step-8 kill); the first now
    # starts 6 steps before it, and whichever is complete is restored.
    summary, state = run_elastic(tmp_path, nodes=4, pipelines=2, checkpoint_every=2,
                                 inject=("kill:node=0,step=8", "kill:node=2,step=8"))
    check_same_training(summary, state, reference)
    # one fallback (a starved machine has also lost a node to its lease after it: a re-plan more)
    (fallback,) = [r for r in summary.recoveries if r["restore_checkpoint"] is not None]
    assert fallback["restore_checkpoint"] in (2, 4, 6), summary.recoveries
    assert "CHECKPOINT FALLBACK" in fallback["reason"]


def test_every_holder_lost_without_a_checkpoint_fails_the_job_with_the_leaders_reason(tmp_path: Path) -> None:
    # The same losses with no checkpoint to fall back to: the leader gives up (`fatal`) and the
    # launcher ends the run with its reason instead of waiting out the timeout.
    with pytest.raises(JobFailed, match="the leader gave up: .*no live holder and no complete checkpoint"):
        run_elastic(tmp_path, nodes=4, pipelines=2, checkpoint_every=0,
                    inject=("kill:node=0,step=8", "kill:node=2,step=8"))
