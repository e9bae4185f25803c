"""`elastic run --resume RUN_DIR`: the earlier run's checkpoint manifest, the flags it fills in
(--global-batch, --data) and the checkpoint to start from, checked to continue that run exactly
(UsageError, exit 2, otherwise)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from elastic.cli.main import UsageError


def _resume_manifest(args: argparse.Namespace) -> Any:
    """The manifest of the run to resume (None when it has none); UsageError if unreadable."""
    from elastic.coordinator.jsonrecord import RecordError
    from elastic.records.resume import CheckpointManifest

    try:
        return CheckpointManifest.load(args.resume / "checkpoints")
    except (RecordError, OSError) as exc:
        raise UsageError(f"--resume {args.resume}: unreadable checkpoint manifest: {exc}") from None


def resume_defaults(args: argparse.Namespace) -> None:
    """With --resume: check the flags that go with it, and take --global-batch and --data from the
    earlier run when they are not given (they fix the samples of every step)."""
    if args.resume is None:
        return
    if args.static:
        raise UsageError("--resume needs the control plane: it cannot take --static")
    if not args.resume.is_dir():
        raise UsageError(f"--resume {args.resume}: no such run directory")
    manifest = _resume_manifest(args)
    if manifest is not None:
        if args.global_batch is None and args.plan is None:
            args.global_batch = manifest.global_batch
        if args.data is None:
            args.data = manifest.data_path


def resume_config(args: argparse.Namespace, config: Any) -> Any:
    """`config` with the checkpoint to resume from (--resume), after checking it continues the
    earlier run exactly; UsageError (exit 2) for a missing, corrupt or incomplete checkpoint, or
    one of another model shape, batch or data."""
    if args.resume is None:
        return config
    import dataclasses

    from elastic.engine.checkpoint.files import CheckpointError
    from elastic.engine.checkpoint.resume import find_resume_point
    from elastic.records.resume import CheckpointManifest, compare_runs

    spec = config.spec
    try:
        source = find_resume_point(args.resume, spec.model_config)
    except CheckpointError as exc:
        raise UsageError(f"--resume {args.resume}: {exc}") from None
    earlier = _resume_manifest(args)
    if earlier is not None:
        ours = CheckpointManifest(model=spec.model, model_config=spec.model_config,
                                  global_batch=spec.plan.global_batch, data_seed=spec.data_seed,
                                  data_path=spec.data_path, optim=spec.optim)
        refusals, notes = compare_runs(earlier, ours)
        if refusals:
            raise UsageError(f"--resume {args.resume}: {refusals[0]}")
        for note in notes:
            print(f"elastic run: note: {note}", file=sys.stderr, flush=True)
    if source.step >= spec.steps:
        raise UsageError(f"--resume {args.resume}: its checkpoint is at step {source.step}; --steps {spec.steps} "
                         "leaves nothing to run")
    for skipped in source.skipped:
        print(f"elastic run: warning: the checkpoint of step {skipped.step} of {args.resume} cannot be used "
              f"({skipped.why}); falling back to the one before", file=sys.stderr, flush=True)
    return dataclasses.replace(config, resume=source)
