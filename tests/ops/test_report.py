"""`elastic report` on a real static run's summary.json, and its errors on bad run directories.

The elastic side (wall-time timeline, a recovery marked) is checked on the live run of
test_metrics.py; here a static run (one worker, no control plane: no wall times) is reported,
so the steps are laid end to end.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from elastic.cli.main import main
from elastic.engine.optim import OptimConfig
from elastic.ops.report import DPI, FIGSIZE, ReportError, load_timeline, summary_text, write_report
from elastic.records.job import JobSpec
from elastic.records.summary import RunSummary
from elastic.roles.static_launcher import launch
from templates.plan import even_plan

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

STEPS = 4


@pytest.fixture(scope="module")
def static_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, RunSummary]:
    """A 4-step static run of tiny on one worker, its summary written where `elastic report` reads it."""
    run_dir = tmp_path_factory.mktemp("static-run")
    plan = even_plan(num_layers=6, nodes=[0], num_pipelines=1, global_microbatches=2, microbatch_size=2)
    spec = JobSpec(model="tiny", plan=plan, steps=STEPS, run_dir=str(run_dir), optim=OptimConfig(lr=1e-3),
                   device="cpu", collective_timeout_s=60.0)
    summary = launch(spec, quiet=True, timeout_s=80)
    (run_dir / "summary.json").write_text(summary.to_json())
    return run_dir, summary


def numbers(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"-?\d+(?:\.\d+)?", text)]


def test_png_of_a_static_run(static_run: tuple[Path, RunSummary]) -> None:
    import matplotlib.image

    run_dir, summary = static_run
    path = write_report(run_dir)
    assert path == run_dir / "report.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(path)
    assert image.shape == (int(FIGSIZE[1] * DPI), int(FIGSIZE[0] * DPI), 4)
    assert image[..., :3].std() > 0.05  # something was drawn on the white canvas


def test_timeline_of_a_static_run(static_run: tuple[Path, RunSummary]) -> None:
    run_dir, summary = static_run
    t = load_timeline(run_dir)
    assert t.losses == summary.losses and len(t.times) == STEPS
    assert t.times[-1] == pytest.approx(sum(summary.step_seconds))
    tokens = summary.global_batch * summary.seq_len
    assert t.throughput == pytest.approx([tokens / s for s in summary.step_seconds])
    assert t.recoveries == [] and t.origin == 0.0


def test_text_summary_numbers(static_run: tuple[Path, RunSummary]) -> None:
    run_dir, summary = static_run
    text = summary_text(run_dir)
    steps, seconds, final, first, tokens_per_s, median_ms = numbers(text)[:6]
    assert steps == summary.steps_committed == STEPS
    assert seconds == pytest.approx(sum(summary.step_seconds), abs=0.05)
    assert final == pytest.approx(summary.losses[-1], abs=5e-5)
    assert first == pytest.approx(summary.losses[0], abs=5e-5)
    assert tokens_per_s == pytest.approx(summary.tokens_per_s, abs=0.5)
    assert median_ms == pytest.approx(summary.steady_step_s * 1000, abs=0.5)
    assert text.endswith("No failures or recoveries.")


def test_cli_prints_path_and_summary(
    static_run: tuple[Path, RunSummary], capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, _ = static_run
    assert main(["report", str(run_dir)]) == 0
    path, text = capsys.readouterr().out.strip().split("\n")
    assert Path(path) == run_dir / "report.png" and path and text == summary_text(run_dir)


def test_missing_directory_and_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not exist" in err
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "summary.json not found" in err
    with pytest.raises(ReportError, match="does not exist"):
        write_report(tmp_path / "nope")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "is not JSON"),
        ("[1, 2]", "must hold a JSON object"),
        ('{"losses": []}', "has no 'steps_committed'"),
        ('{"steps_committed": 2, "losses": [1.0], "step_seconds": [0.1], "global_batch": 8, "seq_len": 64}',
         "disagree on the step count"),
        ('{"steps_committed": 1, "losses": ["x"], "step_seconds": [0.1], "global_batch": 8, "seq_len": 64}',
         "'losses' must be a list of numbers"),
    ],
)
def test_malformed_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, message: str
) -> None:
    (tmp_path / "summary.json").write_text(content)
    assert main(["report", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("elastic report: error: ") and message in err
    assert not (tmp_path / "report.png").exists()
    with pytest.raises(ReportError, match=re.escape(message)):
        write_report(tmp_path)


def test_summary_of_a_recovery_entry(static_run: tuple[Path, RunSummary], tmp_path: Path) -> None:
    """Recovery wording and totals, on the static run's summary with two recovery entries added."""
    _, summary = static_run
    data = json.loads(summary.to_json())
    t0 = 1000.0
    data["started_at"] = t0
    data["step_committed_at"] = [t0 + 1 + i for i in range(STEPS)]
    data["step_generations"] = [1, 1, 2, 3]
    data["recoveries"] = [
        {"generation": 2, "lost_nodes": [2], "joined_nodes": [], "total_s": 1.25, "bytes_moved": 300,
         "restore_checkpoint": None, "fault_at": t0 + 2.2, "published_at": t0 + 2.4, "first_commit_at": t0 + 3,
         "interrupted": False},
        {"generation": 3, "lost_nodes": [], "joined_nodes": [2], "drained_nodes": [3], "total_s": 0.5, "bytes_moved": 200,
         "restore_checkpoint": 0, "fault_at": t0 + 3.1, "published_at": t0 + 3.2, "first_commit_at": t0 + 4,
         "interrupted": False},
    ]
    (tmp_path / "summary.json").write_text(json.dumps(data))
    text = summary_text(tmp_path)
    assert "2 recoveries, 1.75 s and 500 bytes in all" in text
    assert "generation 2 (node 2 lost): 1.25 s, 300 bytes moved" in text
    assert "generation 3 (node 2 joined, node 3 drained): 0.50 s, 200 bytes moved, restored the checkpoint of step 0" in text
    assert load_timeline(tmp_path).times == [1.0, 2.0, 3.0, 4.0]
    assert write_report(tmp_path).exists()


def test_straggler_marks_are_shaded_from_the_saved_history(static_run: tuple[Path, RunSummary], tmp_path: Path) -> None:
    """The marks of `history/events.json` as spans since the start: a cleared one, one open at the
    end, and nothing from another run's history or from malformed entries."""
    _, summary = static_run
    data = json.loads(summary.to_json())
    t0 = 1000.0
    data["started_at"] = t0
    data["step_committed_at"] = [t0 + 1 + i for i in range(STEPS)]
    data["step_generations"] = [1] * STEPS
    (tmp_path / "summary.json").write_text(json.dumps(data))
    (tmp_path / "history").mkdir()
    events = [
        {"kind": "straggler", "time": t0 - 100.0, "detail": {"node": 2}},  # an earlier run's
        {"kind": "straggler-cleared", "time": t0 - 90.0, "detail": {"node": 2}},
        {"kind": "straggler", "time": t0 + 1.5, "detail": {"node": 1, "factor": 1.8}},
        {"kind": "straggler", "time": t0 + 2.5, "detail": {"node": 3}},
        {"kind": "straggler-cleared", "time": t0 + 3.5, "detail": {"node": 1}},
        {"kind": "straggler", "time": "soon", "detail": {"node": 4}},
        {"kind": "straggler", "time": t0 + 2.0, "detail": "node 5"},
        {"kind": "join", "time": t0 + 0.5, "detail": {"incarnation": 0}},
    ]
    (tmp_path / "history" / "events.json").write_text(json.dumps(events))
    assert load_timeline(tmp_path).slow_spans == [(1.5, 3.5, 1), (2.5, 4.0, 3)]  # to the last commit, 4 s
    assert write_report(tmp_path).exists()
    (tmp_path / "history" / "events.json").write_text("{not json")
    assert load_timeline(tmp_path).slow_spans == []  # the report draws without the history
