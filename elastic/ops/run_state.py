"""The trained model a run directory holds, for the commands that take it out (`elastic export`,
`elastic sample`): its job spec, its full parameters (the final state or a checkpoint's) and
the tokenizer its data came with.

The job spec is `<run_dir>/spec.json` (written by `elastic run` with the control plane) or
`<run_dir>/job.json` (written by `--static` runs; with the control plane that file holds the
job's etcd address instead). The final state is pipeline 0's per-stage files
(`records/summary.load_final_state`); a checkpoint's parameters are read by
`engine/checkpoint/params.py`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from elastic.records.job import JobSpec
from elastic.records.summary import load_final_state

SPEC_FILE = "spec.json"
"""The job spec of an elastic run, in its run directory (written by the launcher)."""
TOKENIZER_FILE = "tokenizer.json"
"""A Hugging Face `tokenizers` file; `elastic prepare-data` writes one next to its token file."""


class RunStateError(ValueError):
    """The run directory does not hold what was asked for (one line for the user)."""


def read_spec(run_dir: Path) -> JobSpec:
    """The job spec of the run in `run_dir`, its run_dir replaced by `run_dir` (the run may have
    named it relative to another working directory)."""
    for name in (SPEC_FILE, "job.json"):
        path = run_dir / name
        if not path.is_file():
            continue
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise RunStateError(f"{path}: not readable JSON: {exc}") from None
        if isinstance(raw, dict) and "plan" in raw and "model" in raw:
            spec = JobSpec.from_json(path.read_text())
            return dataclasses.replace(spec, run_dir=str(run_dir))
    raise RunStateError(
        f"{run_dir} holds no job spec ({SPEC_FILE}, or job.json of a --static run): is it an `elastic run` run directory?"
    )


def final_state(spec: JobSpec) -> dict[str, torch.Tensor]:
    """Canonical name -> full fp32 tensor of the run's final parameters."""
    try:
        return load_final_state(spec)
    except FileNotFoundError as exc:
        raise RunStateError(
            f"{spec.run_dir} has no final state ({exc.filename}): the run did not finish; give --step S "
            "for one of its checkpoints"
        ) from None


def data_tokenizer(spec: JobSpec) -> Path | None:
    """The `tokenizer.json` the run's data came with: next to its token file, or inside its
    directory of shards; None for the built-in corpus and byte-level text."""
    if spec.data_path is None:
        return None
    data = Path(spec.data_path)
    candidate = data / TOKENIZER_FILE if data.is_dir() else data.parent / TOKENIZER_FILE
    return candidate if candidate.is_file() else None
