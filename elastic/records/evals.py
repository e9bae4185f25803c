"""Validation losses of an elastic run (`--eval-every`): the `eval` key and the local eval logs.

After each evaluation (elastic/engine/eval.py) world rank 0 of the generation appends an
`EvalResult` to its local log `<run_dir>/evals/node<N>.worker<L>.jsonl` and overwrites the job's
one `eval` key with it (one put per evaluation, never a per-step history in etcd). The launcher
prints a line for each put it sees, `elastic status` and the metrics show the key, and the run
summary merges the key's puts with the local logs (`eval_losses`). A recovery at a step boundary
where an evaluation is due evaluates again: the same value, the newest generation's copy kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from elastic.coordinator.jsonrecord import JsonRecord, RecordError
from elastic.coordinator.keys import JobKeys


@dataclass(frozen=True, kw_only=True)
class EvalResult(JsonRecord):
    """One evaluation of the held-out split."""

    step: int
    """Steps committed when it ran (it follows step `step` as `elastic run` numbers steps)."""
    loss: float
    """Mean loss over the held-out microbatches."""
    batches: int
    """Held-out microbatches it averaged over."""
    generation: int
    """The generation that computed it."""
    at: float
    """Wall time it finished (Unix seconds)."""
    seconds: float
    """Its wall time on the writer."""


def eval_key(keys: JobKeys) -> str:
    """The job's `eval` key: the latest evaluation."""
    return keys.key("eval")


def eval_log_path(run_dir: str | Path, node: int, local_rank: int) -> Path:
    """The local log of the evaluations worker (node, local_rank) wrote as world rank 0."""
    return Path(run_dir) / "evals" / f"node{node}.worker{local_rank}.jsonl"


def append_eval_log(run_dir: str | Path, node: int, local_rank: int, result: EvalResult) -> None:
    """Append `result` to the worker's local eval log (a killed writer's torn line is ended first)."""
    path = eval_log_path(run_dir, node, local_rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    torn = path.exists() and path.stat().st_size > 0 and not path.read_bytes().endswith(b"\n")
    with path.open("a") as log:
        log.write(("\n" if torn else "") + result.to_json() + "\n")


def newer(results: dict[int, EvalResult], result: EvalResult) -> None:
    """Keep `result` in `results` (by step) unless an evaluation of a newer generation is there."""
    known = results.get(result.step)
    if known is None or result.generation >= known.generation:
        results[result.step] = result


def read_eval_logs(run_dir: str | Path) -> dict[int, EvalResult]:
    """Every evaluation in the run's local eval logs, by step (newest generation wins; torn or
    malformed lines skipped)."""
    out: dict[int, EvalResult] = {}
    for path in sorted((Path(run_dir) / "evals").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                newer(out, EvalResult.from_json(line))
            except RecordError:
                continue
    return out


def eval_losses(results: dict[int, EvalResult], *, up_to: int) -> list[list[float]]:
    """The summary's `eval_losses`: [[step, loss], ...] by step, steps <= `up_to` only."""
    return [[step, results[step].loss] for step in sorted(results) if step <= up_to]
