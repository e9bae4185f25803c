"""Stragglers on a live run (real etcd, agents, workers; issue 33, `--straggler-policy rebalance`):
node 1 of 2 (2 one-stage pipelines, 4 microbatches each: one node a core of this 2-core
machine, as on a cluster each node has its own devices) is throttled at half speed with real
SIGSTOP/SIGCONT (`elastic inject slow --factor 2`) for a few seconds mid-run.

- The reporter marks node 1, and only node 1, while it is slow, and clears the mark after the
  release; `events` has both, `status` shows the mark while it lasts.
- The leader re-splits the global batch at a step boundary, fewer microbatches for node 1's
  pipeline (generation 2, its reason names the estimates), and back to the planner's split once
  node 1 is as fast again (the last generation). Nothing is lost or recomputed: no node lost, no
  replay, and the final state and every loss equal the failure-free run's (1e-5).

Why one core a node: with more simulated nodes than cores, a node's speed depends on what runs
beside it. A pipeline given fewer microbatches computes only while every other node does, and
reads up to 1.5x slow per microbatch; it is then marked (and re-split for) although nothing is
wrong with it. bench/README.md has that run.

`--straggler-policy off` is tests/faults/test_slow_node.py's run; the detector on recorded series
of this machine (noise, spikes, slowdowns) and the split against every split:
tests/planning/test_stragglers.py."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from elastic.coordinator import EtcdServer
from elastic.coordinator.events import read_events
from elastic.ops.status_read import read_status
from elastic.ops.status_table import render_table
from elastic.planning.stragglers import StragglerConfig
from elastic.records.generation import GenerationRecord
from elastic.records.stragglers import StragglerRecord, read_stragglers
from elastic.records.summary import RunSummary

from .runs import LiveJob, check_same_training, reference_run, tiny_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

STEPS = 120
MICROBATCHES = 8
"""4 a pipeline: a node's busy time of a step (about 100 ms here) well above this machine's noise."""
SLOW_NODE = 1
SLOW_AT = 10
"""Committed steps before the throttle starts."""
SLOW_S = 6.0
"""20 slowed steps or more even where a step takes 0.2 s (0.1 s on an idle 2-core machine)."""
DETECTOR = StragglerConfig(policy="rebalance", threshold=1.6, clear_below=1.125)
"""Above this machine's noise: a CI run under the default 1.25 also marked node 0, at 1.33x for
10 steps, with the background lane's tests beside it (test_straggler_auto.py saw 1.39x). The
throttled node reads 2.0-2.1x; the clearing point is the default threshold's."""


class Outcome:
    def __init__(self, job: LiveJob, code: int, output: str, shown: str, slow_at: float) -> None:
        self.summary, self.state = job.result()
        self.code, self.output, self.shown, self.slow_at = code, output, shown, slow_at
        self.events = read_events(job.client, job.keys)
        self.marks = [e for e in self.events if e["kind"] in ("straggler", "straggler-cleared")]
        self.record: StragglerRecord | None = read_stragglers(job.client, job.keys)
        self.generations = {int(m.key.decode().rsplit("/", 1)[1]): GenerationRecord.from_json(v)
                            for v, m in job.client.get_prefix(job.keys.plans)}


def _status_with_a_mark(job: LiveJob, timeout: float) -> str:
    """`elastic status` as a table, the first time it shows a straggler."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = read_status(job.client, job.keys, etcd=job.etcd)
        if any(n.straggler is not None for n in status.nodes):
            return render_table(status)
        time.sleep(0.1)
    raise AssertionError(f"status showed no straggler within {timeout} s")


@pytest.fixture(scope="module")
def outcome(etcd_server: EtcdServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Outcome]:
    config = dataclasses.replace(
        tiny_config(tmp_path_factory.mktemp("stragglers"), nodes=2, pipelines=2, steps=STEPS,
                    global_microbatches=MICROBATCHES),
        stragglers=DETECTOR)
    job = LiveJob(config, etcd=etcd_server.endpoint, timeout_s=200.0).start()
    try:
        job.wait_committed(SLOW_AT)
        slow_at = time.time()
        code, output = job.cli("inject", "slow", "--node", str(SLOW_NODE), "--factor", "2",
                               "--seconds", str(SLOW_S), "--wait", "0")
        shown = _status_with_a_mark(job, SLOW_S + 30)
        yield Outcome(job, code, output, shown, slow_at)
    finally:
        job.close()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[RunSummary, dict[str, torch.Tensor]]:
    return reference_run(tmp_path_factory, steps=STEPS, global_microbatches=MICROBATCHES)


def test_the_slow_node_is_marked_while_slow_and_cleared_after(outcome: Outcome) -> None:
    assert outcome.code == 0, outcome.output
    print("\n".join(f"{e['kind']}: node {e['node']} step {e['step']} factor {e['factor']}: {e['reason']}"
                    for e in outcome.marks))
    assert [(e["kind"], e["node"]) for e in outcome.marks] == [("straggler", SLOW_NODE),
                                                               ("straggler-cleared", SLOW_NODE)]
    marked, cleared = outcome.marks
    assert outcome.slow_at < marked["time"] < outcome.slow_at + SLOW_S + 1.0, "marked while the node was slow"
    assert marked["factor"] >= DETECTOR.threshold and cleared["time"] > outcome.slow_at + SLOW_S
    assert cleared["factor"] < DETECTOR.recovered_below
    print(outcome.shown)
    assert f"stragglers: node {SLOW_NODE} (" in outcome.shown, outcome.shown
    header = [line for line in outcome.shown.splitlines() if line.lstrip().startswith("node  alive")]
    assert header and "speed" in header[0], outcome.shown
    record = outcome.record
    assert record is not None and record.policy == "rebalance" and record.marked == {}, record
    assert sorted(record.factors) == sorted(record.busy) == [0, 1], record


def test_the_batch_is_resplit_while_it_is_slow_and_back_after_with_nothing_lost(
    outcome: Outcome, reference: Any
) -> None:
    gens = outcome.generations
    for g, rec in sorted(gens.items()):
        print(g, rec.resume_step, [p.microbatches for p in rec.plan.pipelines], rec.reason)
    assert sorted(gens) == list(range(1, len(gens) + 1)) and len(gens) >= 3, [r.reason for r in gens.values()]
    first, slowed, back = gens[1], gens[2], gens[len(gens)]
    assert [p.microbatches for p in first.plan.pipelines] == [4, 4]
    counts = [p.microbatches for p in slowed.plan.pipelines]
    assert sum(counts) == MICROBATCHES and counts[1] < counts[0], counts  # node 1 is pipeline 1
    assert slowed.reason.startswith(f"rebalance for straggler(s) node {SLOW_NODE} at ") and "doing nothing" in slowed.reason
    assert slowed.balanced_for == [SLOW_NODE]
    assert [p.microbatches for p in back.plan.pipelines] == [4, 4], back.reason  # the way back: the planner's split
    for rec in list(gens.values())[1:]:  # step boundaries: nobody lost, nothing replayed or restored
        assert rec.reason.startswith("rebalance"), rec.reason
        assert rec.lost == [] and rec.joined == [] and rec.replay is None and rec.restore_checkpoint is None
        assert [[(s.node, s.layers) for s in p.stages] for p in rec.plan.pipelines] == \
            [[(s.node, s.layers) for s in p.stages] for p in first.plan.pipelines]
    check_same_training(outcome.summary, outcome.state, reference, steps=STEPS)
