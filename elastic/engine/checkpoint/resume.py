"""Choosing the checkpoint a resumed run starts from (`elastic run --resume RUN_DIR`).

The newest step of `RUN_DIR/checkpoints` that is complete (every shard committed), whole (every
file matches its marker's CRC-32) and of this model's shape wins. A newer step that is
incomplete or corrupt is skipped, and the reason is kept so the run can say so; a checkpoint of
another model shape is refused outright (no older step of the same run would fit either).
"""

from __future__ import annotations

from pathlib import Path

from elastic.engine.checkpoint.files import (
    CheckpointError,
    committed_keys,
    list_steps,
    read_marker,
    verify_data,
)
from elastic.engine.checkpoint.load import slice_markers
from elastic.engine.checkpoint.reshard import CheckpointMismatch, check_shapes
from elastic.model.config import GPTConfig
from elastic.records.resume import ResumeSource, SkippedCheckpoint

__all__ = ["find_resume_point", "verify_crcs", "verify_step"]


def verify_step(directory: Path, step: int, cfg: GPTConfig) -> int:
    """The tensor-parallel degree of step `step`'s checkpoint once it is known complete, of model
    `cfg` (CheckpointMismatch otherwise) and whole: every file of every shard matches its CRC-32
    (CheckpointError naming the first that does not)."""
    degree = check_shapes(directory, step, cfg)
    verify_crcs(directory, step)
    return degree


def verify_crcs(directory: Path, step: int) -> None:
    """Every file of every shard of step `step`'s (complete) checkpoint matches its marker's
    CRC-32: CheckpointError naming the first that does not. What a running job's fallback checks
    (its own checkpoints have its model's shapes)."""
    for key in committed_keys(directory, step):
        marker = read_marker(directory, step, key)
        assert marker is not None
        verify_data(directory, marker)
        for piece in slice_markers(directory, marker):  # a shard written sliced: its slices too
            verify_data(directory, piece)


def find_resume_point(run_dir: Path, cfg: GPTConfig, *, checkpoint_dir: Path | None = None) -> ResumeSource:
    """The checkpoint of `run_dir` a resumed run of model `cfg` starts from: the newest usable
    step, with the newer ones it skipped and why. CheckpointError when there is none,
    CheckpointMismatch for a checkpoint of another model shape."""
    directory = Path(checkpoint_dir) if checkpoint_dir is not None else Path(run_dir) / "checkpoints"
    steps = list_steps(directory)
    if not steps:
        raise CheckpointError(f"{run_dir} has no checkpoint (no step directory in {directory})")
    skipped: list[SkippedCheckpoint] = []
    for step in reversed(steps):
        try:
            degree = verify_step(directory, step, cfg)
        except CheckpointMismatch:
            raise
        except CheckpointError as exc:
            skipped.append(SkippedCheckpoint(step=step, why=str(exc)))
            continue
        return ResumeSource(run_dir=str(run_dir), checkpoint_dir=str(directory), step=step, tp_degree=degree,
                            skipped=skipped)
    reasons = "; ".join(f"step {s.step}: {s.why}" for s in skipped)
    raise CheckpointError(f"{run_dir} has no usable checkpoint: {reasons}")
