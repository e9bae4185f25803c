"""What a resumed run starts from (`elastic run --resume RUN_DIR`) and what every run leaves
beside its checkpoints so that a later run can continue it.

A run's checkpoints (`<run_dir>/checkpoints/step-*/`, elastic/engine/checkpoint/files.py) hold
parameters and AdamW state per (layer, tp_rank) shard; the LR schedule, the sample order and the
dropout masks are pure functions of the step number. `CheckpointManifest` records the rest that
fixes what step s computes (model shape, global batch, data, optimizer), so a resumed run can
check it takes exactly the steps the earlier run would have taken next. `ResumeSource` names
the checkpoint a resumed run starts from, and the newer ones it had to skip.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from elastic.coordinator.jsonrecord import JsonRecord
from elastic.model.config import GPTConfig
from elastic.records.optim_config import OptimConfig

MANIFEST_FILE = "manifest.json"
"""Name of the manifest in a run's checkpoint directory."""


@dataclass(frozen=True, kw_only=True)
class CheckpointManifest(JsonRecord):
    """The settings of the run that wrote a checkpoint directory, beyond the tensors themselves."""

    model: str
    """Model preset name of the run."""
    model_config: GPTConfig
    """The model's shape (the preset with any overrides)."""
    global_batch: int
    """Samples per step: with the seed and the data, it fixes the samples of every step."""
    data_seed: int
    """Seed of the sample order."""
    data_path: str | None
    """Corpus file (None: the built-in corpus)."""
    optim: OptimConfig
    """Optimizer and learning-rate schedule."""

    def save(self, directory: str | Path) -> Path:
        """Write the manifest into `directory` (created if needed); its path."""
        path = Path(directory) / MANIFEST_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{MANIFEST_FILE}.tmp")
        tmp.write_text(self.to_json(indent=1))
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, directory: str | Path) -> CheckpointManifest | None:
        """The manifest of a checkpoint directory, or None when it has none (RecordError if unreadable)."""
        path = Path(directory) / MANIFEST_FILE
        return cls.from_json(path.read_text()) if path.is_file() else None


@dataclass(frozen=True, kw_only=True)
class SkippedCheckpoint:
    """A checkpoint newer than the one a resume uses, and why it could not be used."""

    step: int
    """Its step."""
    why: str
    """Why it was skipped (incomplete, corrupt), in words."""


@dataclass(frozen=True, kw_only=True)
class ResumeSource:
    """The checkpoint a resumed run starts from."""

    run_dir: str
    """The earlier run's directory, as the user named it."""
    checkpoint_dir: str
    """Its checkpoint directory."""
    step: int
    """The checkpoint's step: the resumed run's first step is this one (0-based)."""
    tp_degree: int
    """Tensor-parallel degree the checkpoint was written at (shards are resharded when the
    resumed run's degree differs)."""
    skipped: list[SkippedCheckpoint] = field(default_factory=list)
    """Newer checkpoints that were incomplete or corrupt, newest first."""

    def describe(self) -> str:
        """"resumed from step N of RUN_DIR", with the checkpoints skipped."""
        text = f"resumed from step {self.step} of {self.run_dir}"
        if self.tp_degree:
            text += f" (checkpoint written at tensor-parallel degree {self.tp_degree})"
        for s in self.skipped:
            text += f"; skipped the checkpoint of step {s.step}: {s.why}"
        return text


_SHAPE_FIELDS = ("arch", "vocab_size", "seq_len", "n_layer", "n_head", "d_model", "rope_theta", "norm_eps", "rope_factor",
                 "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_context", "tie_embeddings",
                 "qkv_bias")
_DERIVED = (("kv_heads", "n_head"), ("d_ff", "d_model"))
"""Shape figures that follow another field by default: named only where that field is the same."""


def compare_runs(earlier: CheckpointManifest, resumed: CheckpointManifest) -> tuple[list[str], list[str]]:
    """What keeps `resumed` from continuing `earlier` exactly (refusals: another model shape,
    global batch, data or sample order), and what it changes knowingly (notes: the optimizer,
    dropout)."""
    refusals, notes = [], []
    a, b = earlier.model_config, resumed.model_config
    shape = [f"{f} {getattr(a, f)} -> {getattr(b, f)}" for f in _SHAPE_FIELDS if getattr(a, f) != getattr(b, f)]
    shape += [f"{f} {getattr(a, f)} -> {getattr(b, f)}" for f, base in _DERIVED
              if getattr(a, f) != getattr(b, f) and getattr(a, base) == getattr(b, base)]
    if shape:
        refusals.append(f"the checkpoint is of another model shape ({', '.join(shape)})")
    for what, old, new in (("global batch", earlier.global_batch, resumed.global_batch),
                           ("data seed (--seed)", earlier.data_seed, resumed.data_seed),
                           ("data (--data)", earlier.data_path, resumed.data_path)):
        if old != new:
            refusals.append(f"the checkpoint's run used {what} {old}, this run {new}: they fix the samples of every step")
    if earlier.optim != resumed.optim:
        notes.append(f"the optimizer settings change from {earlier.optim} to {resumed.optim}")
    if (a.dropout, a.init_seed) != (b.dropout, b.init_seed):
        notes.append(f"dropout {a.dropout} -> {b.dropout}, init seed {a.init_seed} -> {b.init_seed}")
    return refusals, notes
