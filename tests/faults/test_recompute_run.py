"""`elastic run --recompute` on real processes (issue 54, recomputation): tiny on 4 nodes x 2
workers (TP 2), node 3 SIGKILLed at step 9 and recovered without restart, with `selective` and
`full` recomputation, and with `auto` at a budget where the planner mixes `full` and `none`
stages: each final state is the `none` run's, bit for bit (recomputation changes what is kept,
never the arithmetic), every step committed, no worker restarted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

STEPS = 10
RUN = [sys.executable, "-m", "elastic.cli", "run", "--model", "tiny", "--nodes", "4", "--gpus-per-node", "2",
       "--fault-tolerance", "1", "--global-batch", "8", "--microbatch", "1", "--steps", str(STEPS), "--device", "cpu",
       "--checkpoint-every", "0", "--inject", "kill:node=3,step=9", "--lease-ttl", "30"]
"""The kill is seen by the node's own monitor, not by its lease: a long lease keeps a stall of
this machine's disk under etcd (fdatasync of 5-13 s seen here, issue 56; a 12 s one plus a 1.4 s
one fenced node 0 under a 15 s lease) from fencing the survivors, which is not what this test is
about."""


AUTO_MIXED = ("--device-memory-gib", "0.012")
"""A budget at which `auto` plans 2 pipelines of 2 stages, the first stage of each under `full`
and the second under `none` (the default budget plans 4 one-node pipelines, none recomputing)."""


def _run(run_dir: Path, mode: str, *extra: str) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
    final = run_dir / "final_state.pt"
    cmd = [*RUN, "--recompute", mode, "--run-dir", str(run_dir), "--final-state", str(final),
           "--summary", str(run_dir / "summary.json"), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=130)
    assert proc.returncode == 0, f"{mode}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return json.loads((run_dir / "summary.json").read_text()), torch.load(final)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
    return _run(tmp_path_factory.mktemp("recompute-none"), "none")


@pytest.mark.parametrize(("mode", "extra"), [("selective", ()), ("full", ()), ("auto", AUTO_MIXED)])
def test_recomputation_trains_bit_for_bit_the_same_through_a_failure(
    mode: str, extra: tuple[str, ...], reference: tuple[dict[str, object], dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    summary, state = _run(tmp_path, mode, *extra)
    ref_summary, ref_state = reference
    for s in (summary, ref_summary):
        assert s["steps_committed"] == STEPS and s["worker_restarts"] == 0
        assert [r["lost_nodes"] for r in s["recoveries"]] == [[3]]  # type: ignore[union-attr, index]
    assert summary["losses"] == ref_summary["losses"]
    assert state.keys() == ref_state.keys()
    differ = [name for name in state if not torch.equal(state[name], ref_state[name])]
    assert not differ, f"{mode}: final parameters differ from the none run's in {differ}"
    if mode == "auto":  # the plan's modes reached the workers: the first stages recomputed, the rest did not
        first = [log.name for log in (tmp_path / "logs").glob("*.log") if "generation 1: " in log.read_text()
                 and "stage 0 tp" in log.read_text() and " recompute full)" in log.read_text()]
        assert sorted(first) == [f"node{n}.worker{w}.inc0.log" for n in (0, 2) for w in (0, 1)], first
        assert all(" recompute " not in log.read_text() for n in (1, 3) for log in (tmp_path / "logs").glob(f"node{n}.*"))
