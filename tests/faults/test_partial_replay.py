"""Partial replay and the collective shard path on real processes: a node SIGKILLed or
SIGSTOPped mid-step costs only the microbatches of its own pipeline. The pipeline that lost no
node finishes its microbatches, its workers keep their gradient sums through the re-plan, and
the new generation computes the rest; the lost node's layers move over the new generation's
gloo group. The final state is bit-identical to the failure-free run's, to the same failure with
the whole step replayed (partial replay off), to shards moved over gRPC, and with every node's
store calls relayed by its agent (`ELASTIC_STORE_RELAY=1`)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic.coordinator.probe import PROBE_DEADLINE_S
from elastic.records.summary import RunSummary

from .runs import check_same_training, max_rel_diff, reference_run, run_elastic

pytestmark = [pytest.mark.timeout(200), pytest.mark.slow]

Reference = tuple[RunSummary, dict[str, torch.Tensor]]
HANG_TTL_S = 3
"""The runs' lease TTL (tiny_config's default)."""
ETCD_SWEEP_S = 0.5
"""etcd revokes expired leases in a sweep this often (its lessor): a lease goes up to this late."""
PROBE_SLACK_S = 0.25
"""What a probe of a hung agent may take past its deadline (a fresh channel, a loaded machine)."""
ROUND_SLACK_S = 0.5
"""The member key's delete event to the leader's round, on a loaded machine."""


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    return reference_run(tmp_path_factory, steps=20)


@pytest.mark.parametrize("fault", ["kill", "kill-mid-step", "hang"])
def test_only_the_broken_pipelines_microbatches_are_replayed(fault: str, reference: Reference, tmp_path: Path) -> None:
    # 2 pipelines x 2 stages, 4 microbatches: pipeline 0 (nodes 0, 1) takes 0-1, pipeline 1 (nodes 2, 3) 2-3.
    inject = {"kill": "kill:node=2,step=8", "kill-mid-step": "kill:node=2,step=8,at=0.5", "hang": "hang:node=2,step=8"}
    summary, state = run_elastic(tmp_path, nodes=4, pipelines=2, inject=(inject[fault],))
    check_same_training(summary, state, reference)
    assert max_rel_diff(state, reference[1]) == 0.0  # one summation tree: where the microbatches were summed is irrelevant
    (rec,) = summary.recoveries
    assert rec["lost_nodes"] == [2] and rec["restore_checkpoint"] is None
    # Pipeline 0 keeps microbatches 0-1 when the fault lands in step 8's schedule. The injection
    # follows the progress key (up to 0.1 s late, tiny steps take ~50 ms), so it can land in the
    # vote instead: a worker that saw the vote complete goes on to step 9 while its neighbour
    # stopped at 8, the local grace ends step 9, and that step is replayed whole. The mechanism
    # itself is proven deterministically in tests/engine/test_partial_step.py.
    assert (rec["kept_microbatches"], rec["replayed_fraction"]) in (([0, 1], 0.5), ([], 1.0)), rec
    assert rec["finishing_s"] >= 0.0 and rec["planning_s"] >= 0.0
    # Every shard came from a holder inside the new generation: all over its process group.
    assert rec["bytes_moved"] > 0 and rec["bytes_moved_collective"] == rec["bytes_moved"], rec
    if fault == "hang":
        check_hang_detection(rec, tmp_path / "logs")


def check_hang_detection(rec: dict[str, Any], logs: Path) -> None:
    """A hung node (workers and agent SIGSTOPped, etcd healthy) is found by its lease's expiry and
    a probe that gets no answer (elastic/roles/leader_suspects.py): issue 56's "detected within
    TTL + 1 s, as today". Today's part is the lease: it expires at most the TTL after the agent's
    last keep-alive (at or before the SIGSTOP), and etcd revokes expired leases in a sweep every
    0.5 s; the guard adds the probe's deadline, which the leader's log states. So: the probe took
    about its deadline, the rest is within today's TTL + sweep, and the whole within TTL + 1 s
    plus that sweep: 3.1-4.1 s measured over 14 runs on a quiet machine (2026-12-03), the probe
    0.50-0.52 s of each; the worst, 4.07 s, had the lease go about 3.5 s after the SIGSTOP, which
    before the guard would have been detected at about 3.55 s."""
    probes = [float(m) for log in logs.glob("agent*.log")
              for m in re.findall(r"node 2 \(incarnation 0\): lease expired and no answer to the probe within "
                                  r"[\d.]+ s \(probes took ([\d.]+) s\)", log.read_text())]
    assert len(probes) == 1, probes  # one leader probed node 2 once, and found it silent
    (took,) = probes
    lease = rec["detecting_s"] - took
    print(f"hang detected {rec['detecting_s']:.2f} s after the SIGSTOP (TTL {HANG_TTL_S} s): lease expiry and the "
          f"leader's round {lease:.2f} s, the probe {took:.2f} s")
    assert PROBE_DEADLINE_S - 0.02 <= took <= PROBE_DEADLINE_S + PROBE_SLACK_S, rec
    assert lease <= HANG_TTL_S + ETCD_SWEEP_S + ROUND_SLACK_S, rec
    assert rec["detecting_s"] <= HANG_TTL_S + 1.0 + ETCD_SWEEP_S, rec


def test_whole_step_replay_over_grpc_gives_the_same_state(reference: Reference, tmp_path: Path) -> None:
    summary, state = run_elastic(tmp_path, nodes=4, pipelines=2, inject=("kill:node=2,step=8",), partial_replay=False,
                                 shard_transport="grpc")
    check_same_training(summary, state, reference)
    assert max_rel_diff(state, reference[1]) == 0.0
    (rec,) = summary.recoveries
    assert rec["kept_microbatches"] == [] and rec["replayed_fraction"] == 1.0, rec
    assert rec["bytes_moved"] > 0 and rec["bytes_moved_collective"] == 0, rec


def test_the_store_relay_changes_nothing(reference: Reference, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTIC_STORE_RELAY", "1")  # the agents read it; their workers get the socket
    summary, state = run_elastic(tmp_path, nodes=4, pipelines=2, inject=("kill:node=2,step=8",))
    check_same_training(summary, state, reference)
    assert max_rel_diff(state, reference[1]) == 0.0
    made = [int(m) for log in (tmp_path / "logs").glob("agent*.log")
            for m in re.findall(r"the store relay made (\d+) etcd requests", log.read_text())]
    assert len(made) >= 3 and all(n > 0 for n in made), made  # the survivors' relays served both generations
