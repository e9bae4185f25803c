"""Validation losses (`--eval-every`) are the same at any layout and after a node's SIGKILL, and
show in the summary, `elastic status`, the metrics and the report.

One static single-worker run is the reference. Against it: a 2-node job with TP 2 (one 2-stage
pipeline, on the session's etcd, so its keys can be read afterwards), and a 4-node job of two
2-stage pipelines whose node 1 is SIGKILLed while step 5 is in flight (the survivors re-plan).
Evaluations follow steps 3, 6 and the last (8), over 3 held-out microbatches: an odd count, so
two pipelines share them unevenly.
"""

from __future__ import annotations

import dataclasses
import json
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from elastic.coordinator import EtcdServer
from elastic.ops.metrics import NodeMetrics
from elastic.ops.report import summary_text, write_report
from elastic.records.evals import read_eval_logs
from elastic.records.injection import parse_injection
from elastic.records.job import JobSpec
from elastic.records.summary import RunSummary, load_final_state
from elastic.roles.launcher import launch_elastic
from elastic.roles.static_launcher import launch
from templates.plan import even_plan

from .runs import OPTIM, TOLERANCE, LiveJob, Result, check_same_training, tiny_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

STEPS = 8
EVERY = 3
BATCHES = 3
EVAL_STEPS = [3, 6, 8]


def with_eval(spec: JobSpec) -> JobSpec:
    return dataclasses.replace(spec, eval_every=EVERY, eval_batches=BATCHES)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Result:
    """One worker, no control plane."""
    plan = even_plan(num_layers=6, nodes=[0], num_pipelines=1, global_microbatches=4, microbatch_size=2)
    spec = with_eval(JobSpec(model="tiny", plan=plan, steps=STEPS, run_dir=str(tmp_path_factory.mktemp("ref")),
                             optim=OPTIM, device="cpu"))
    summary = launch(spec, quiet=True, timeout_s=300)
    return summary, load_final_state(spec)


@dataclass
class TpRun:
    """The TP-2 job and what its etcd and metrics endpoint said once it finished."""

    summary: RunSummary
    run_dir: Path
    status: dict[str, object]
    status_text: str
    scraped: dict[str, float]


@pytest.fixture(scope="module")
def tp_run(etcd_server: EtcdServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TpRun]:
    run_dir = tmp_path_factory.mktemp("tp2")
    config = tiny_config(run_dir, nodes=2, pipelines=1, steps=STEPS, fault_tolerance=0)
    plan = even_plan(num_layers=6, nodes=[0, 1], num_pipelines=1, global_microbatches=4, microbatch_size=2,
                     gpus_per_node=2)
    cluster = dataclasses.replace(config.cluster, gpus_per_node=2)
    config = dataclasses.replace(config, spec=with_eval(dataclasses.replace(config.spec, plan=plan)),
                                 cluster=cluster)
    job = LiveJob(config, etcd=etcd_server.endpoint, timeout_s=200).start()
    try:
        summary, _ = job.result()
        code, out = _status(job, "--json")
        assert code == 0, out
        _, text = _status(job)
        metrics = NodeMetrics(job.client, job.keys, node=0).start(host="127.0.0.1", port=0)
        try:
            assert metrics.address is not None
            scraped = _scrape(metrics.address)
        finally:
            metrics.stop()
        yield TpRun(summary=summary, run_dir=run_dir, status=json.loads(out), status_text=text, scraped=scraped)
    finally:
        job.close()


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory: pytest.TempPathFactory) -> Result:
    run_dir = tmp_path_factory.mktemp("killed")
    config = tiny_config(run_dir, nodes=4, pipelines=2, steps=STEPS)
    config = dataclasses.replace(config, spec=with_eval(config.spec),
                                 injections=(parse_injection("kill:node=1,step=5"),))
    summary = launch_elastic(config, quiet=True, timeout_s=200)
    return summary, load_final_state(config.spec)


def _status(job: LiveJob, *flags: str) -> tuple[int, str]:
    """`elastic status FLAGS --etcd .. --job ..` in this process: (exit code, output)."""
    import contextlib
    import io

    from elastic.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(["status", *flags, "--etcd", job.etcd, "--job", job.job])
    return code, out.getvalue()


def _scrape(address: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {name: float(value) for name, value in (line.rsplit(" ", 1) for line in text.splitlines()
                                                   if line and not line.startswith("#"))}


def check_same_evals(summary: RunSummary, reference: RunSummary) -> None:
    assert [step for step, _ in reference.eval_losses] == EVAL_STEPS
    assert [step for step, _ in summary.eval_losses] == EVAL_STEPS
    for (step, got), (_, want) in zip(summary.eval_losses, reference.eval_losses, strict=True):
        assert abs(got - want) <= TOLERANCE * abs(want), f"eval after step {step}: {got} vs reference {want}"


def test_the_reference_evaluates_the_held_out_split(reference: Result) -> None:
    summary, _ = reference
    losses = [loss for _, loss in summary.eval_losses]
    assert losses[-1] < losses[0]  # training generalises on the held-out tail of the corpus
    assert all(abs(a - b) > 1e-3 for a, b in zip(losses, summary.losses[2::3], strict=False))  # not the training loss


def test_tp2_pipeline_has_the_reference_eval_losses(tp_run: TpRun, reference: Result) -> None:
    check_same_evals(tp_run.summary, reference[0])
    assert tp_run.summary.world_size == 4


def test_killed_node_run_has_the_reference_eval_losses(killed_run: Result, reference: Result) -> None:
    summary, state = killed_run
    assert len(summary.recoveries) == 1 and summary.recoveries[0]["lost_nodes"] == [1]
    check_same_training(summary, state, reference, steps=STEPS)
    check_same_evals(summary, reference[0])


def test_status_shows_the_latest_eval(tp_run: TpRun) -> None:
    last_step, last_loss = tp_run.summary.eval_losses[-1]
    last = tp_run.status["last_eval"]
    assert isinstance(last, dict)
    assert (last["step"], last["loss"], last["batches"]) == (last_step, last_loss, BATCHES)
    assert f"validation loss {last_loss:.4f} after step {last_step}" in tp_run.status_text


def test_metrics_show_the_latest_eval(tp_run: TpRun) -> None:
    last_step, last_loss = tp_run.summary.eval_losses[-1]
    assert tp_run.scraped["elastic_eval_loss"] == pytest.approx(last_loss, rel=1e-12)
    assert tp_run.scraped["elastic_eval_step"] == last_step


def test_summary_local_logs_and_report_show_the_evals(tp_run: TpRun) -> None:
    logs = read_eval_logs(tp_run.run_dir)
    assert [[s, e.loss] for s, e in sorted(logs.items())] == tp_run.summary.eval_losses
    (tp_run.run_dir / "summary.json").write_text(tp_run.summary.to_json())
    assert json.loads((tp_run.run_dir / "summary.json").read_text())["eval_losses"] == tp_run.summary.eval_losses
    assert write_report(tp_run.run_dir).stat().st_size > 0
    step, loss = tp_run.summary.eval_losses[-1]
    assert f"Validation loss {loss:.4f} after step {step} (3 evaluations)" in summary_text(tp_run.run_dir)
