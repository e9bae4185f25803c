"""One live run (real etcd, agents, workers): `elastic inject slow` on node 1, then `elastic drain`
of node 3, both through the CLI against the running job.

Slow: the node's workers are throttled with real SIGSTOP/SIGCONT while 8 steps are in flight
(`--steps`), and the throttle ends with them; no failure
may be declared (no failure report, no new generation until the drain), the test sees the
node's worker stopped for a good part of the window (sampled with psutil) and running after it,
and training is unchanged. Step times while slowed are printed, not asserted (a tiny step is
short enough to slip between throttle periods on a fast machine). Drain: generation 2 leaves
node 3 out ("drained node 3", nothing lost), node 3's workers report done instead of failing,
no failure is recorded, and the final state equals the failure-free run.
"""

from __future__ import annotations

import dataclasses
import json
import re
import statistics
import threading
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
import torch

from elastic.coordinator import EtcdServer
from elastic.coordinator.events import read_events
from elastic.planning.stragglers import StragglerConfig
from elastic.records.generation import GenerationRecord
from elastic.records.injection_requests import read_requests, read_statuses
from elastic.records.node_workers import read_registrations
from elastic.records.stragglers import read_stragglers
from elastic.records.summary import RunSummary

from .runs import LiveJob, check_same_training, reference_run, tiny_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

STEPS = 40
"""Enough steps after the slow-down for the drain, even on a fast machine."""
FACTOR = 4.0
SLOW_STEPS = 8
"""The throttle lasts while this many steps are in flight (`elastic inject slow --steps`)."""


class Outcome:
    """What the run left: summary, final state, and what its etcd says afterwards."""

    def __init__(self, job: LiveJob, result: tuple[RunSummary, dict[str, torch.Tensor]], outputs: dict[str, str],
                 codes: dict[str, int], samples: list[str], after: list[str]) -> None:
        self.summary, self.state = result
        self.samples, self.after = samples, after  # node 1's worker states during and right after the slow-down
        self.outputs, self.codes = outputs, codes
        client, keys = job.client, job.keys
        self.statuses = read_statuses(client, keys.root)
        self.requests = {r.id: r for r in read_requests(client, keys.root)}
        self.events = read_events(client, keys)
        self.failed = [m.key.decode() for _, m in client.get_prefix(keys.failed, keys_only=True)]
        self.records = {
            int(m.key.decode().rsplit("/", 1)[1]): GenerationRecord.from_json(v)
            for v, m in client.get_prefix(keys.plans)
        }
        self.done = {m.key.decode(): v.decode() for v, m in client.get_prefix(job.rk.done)}
        self.stragglers = read_stragglers(client, keys)

    def status_of(self, kind: str) -> Any:
        (rid,) = [i for i, r in self.requests.items() if r.kind == kind]
        return self.statuses[rid]


@pytest.fixture(scope="module")
def outcome(etcd_server: EtcdServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Outcome]:
    # --straggler-policy off: nothing is measured or marked (tests/faults/test_stragglers.py has `report`).
    config = dataclasses.replace(tiny_config(tmp_path_factory.mktemp("slow-drain"), nodes=4, pipelines=2,
                                             steps=STEPS), stragglers=StragglerConfig(policy="off"))
    job = LiveJob(config, etcd=etcd_server.endpoint, timeout_s=200.0).start()
    try:
        job.wait_committed(3)
        worker = psutil.Process(read_registrations(job.client, job.rk, node=1)[(1, 0)].pid)
        samples: list[str] = []
        sampling = threading.Event()

        def sample() -> None:  # node 1's worker state every 10 ms while the slow request is out
            while not sampling.wait(0.01):
                samples.append(worker.status())

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        outputs, codes = {}, {}
        codes["slow"], outputs["slow"] = job.cli("inject", "slow", "--node", "1", "--factor", str(FACTOR),
                                                 "--steps", str(SLOW_STEPS), "--wait", "60")
        sampling.set()
        sampler.join()
        after = [worker.status() for _ in range(20)]
        codes["drain"], outputs["drain"] = job.cli("drain", "--node", "3", "--wait", "60")
        yield Outcome(job, job.result(), outputs, codes, samples, after)
    finally:
        job.close()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[RunSummary, dict[str, torch.Tensor]]:
    return reference_run(tmp_path_factory, steps=STEPS)


def test_slow_node_is_no_failure_and_slows_the_steps(outcome: Outcome, reference: Any) -> None:
    print(outcome.outputs["slow"])
    assert outcome.codes["slow"] == 0, outcome.outputs["slow"]
    status = outcome.status_of("slow")
    assert status.state == "done" and "stopped" in status.detail, status
    # It lasted while SLOW_STEPS steps were in flight: it ended once the step after them was (the
    # status is written a moment later: a short step may have passed meanwhile).
    began = int(re.search(r"slowed from step (\d+)", status.detail).group(1))  # type: ignore[union-attr]
    assert status.step is not None and began + SLOW_STEPS <= status.step <= began + SLOW_STEPS + 2, status
    # No false failure: nobody reported one, and the only reconfiguration is the drain.
    assert outcome.failed == [] and not [e for e in outcome.events if e["kind"] == "failure"]
    assert sorted(outcome.records) == [1, 2] and outcome.records[2].lost == []
    # Policy off: no speed record, no straggler event.
    assert outcome.stragglers is None and not [e for e in outcome.events if e["kind"].startswith("straggler")]
    # The worker was really throttled: stopped for a good part of the window (FACTOR - 1 seconds
    # for each CPU second it uses), and running again afterwards.
    stopped = sum(1 for st in outcome.samples if st == psutil.STATUS_STOPPED) / max(1, len(outcome.samples))
    print(f"node 1's worker stopped in {stopped:.0%} of {len(outcome.samples)} samples")
    assert stopped >= 0.3, f"node 1's worker was stopped in only {stopped:.0%} of the samples"
    assert psutil.STATUS_STOPPED not in outcome.after, outcome.after
    # For the reader: step times before and while slowed (not asserted, see the module doc).
    summary = outcome.summary
    running = [e for e in outcome.events if e["kind"] == "injection" and e["injection"] == "slow"][0]["time"]
    before = [s for s, t in zip(summary.step_seconds[1:], summary.step_committed_at[1:], strict=True) if t < running]
    during = [s for s, t in zip(summary.step_seconds, summary.step_committed_at, strict=True)
              if running + 0.5 < t <= status.at]
    if before and during:
        print(f"slowed / normal median step time: {statistics.median(during) / statistics.median(before):.2f}")


def test_drain_leaves_the_node_out_without_a_failure(outcome: Outcome, reference: Any) -> None:
    print(outcome.outputs["drain"])
    assert outcome.codes["drain"] == 0, outcome.outputs["drain"]
    status = outcome.status_of("drain")
    assert status.state == "done" and status.generation == 2, status
    record = outcome.records[2]
    assert record.drained == [3] and record.lost == [] and 3 not in record.plan.nodes
    assert record.reason.startswith("drained node 3")
    assert len(record.plan.pipelines) >= 2, "the drained generation keeps f+1 pipelines"
    assert [v for k, v in outcome.done.items() if k.endswith("/done/3/0")] == ["drained"], outcome.done
    assert outcome.failed == [], "a drained node reports no failure"
    check_same_training(outcome.summary, outcome.state, reference, steps=STEPS)
    drains = [r for r in outcome.summary.recoveries if r["generation"] == 2]
    assert drains and drains[0]["lost_nodes"] == [] and "drained node 3" in drains[0]["reason"]
    assert drains[0]["drained_nodes"] == [3], drains[0]
    print(json.dumps({k: v for k, v in drains[0].items() if k.endswith("_s")}))
