"""GPT configuration and named presets.

The model is GPT-2 shaped: learned positions, pre-LayerNorm blocks, a GELU MLP of 4x width,
and an untied output head (so that embedding and head may live on different pipeline stages
without a cross-stage weight tie).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

# What a stage's backward recomputes (model/gpt.py): nothing, the attention core, each block;
# or, for a job, "auto": what the planner chose for each stage (templates/cost.py).
from templates.profile import PLANNED_RECOMPUTE as PLANNED_RECOMPUTE
from templates.profile import RECOMPUTE_MODES as RECOMPUTE_MODES


def check_recompute(mode: str) -> str:
    """`mode` if it is one of RECOMPUTE_MODES, else a clear ValueError."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute mode is one of {', '.join(RECOMPUTE_MODES)}, got {mode!r}")
    return mode


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a GPT. All sizes are full (unsharded) sizes."""

    vocab_size: int = 256
    """Number of token ids; divisible by the tensor-parallel degree."""
    seq_len: int = 64
    """Tokens per sample (the context length)."""
    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; divisible by the tensor-parallel degree."""
    d_model: int = 128
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout probability on attention weights, residual branches and embeddings."""
    init_seed: int = 1234
    """Base seed; every parameter's initial value derives from it and its canonical name."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GPTConfig.{name} must be positive, got {getattr(self, name)}")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def d_ff(self) -> int:
        return 4 * self.d_model

    @property
    def num_layers(self) -> int:
        """Planning layers: embedding, n_layer blocks, final norm + head."""
        return self.n_layer + 2

    def layer_kind(self, index: int) -> str:
        """'embedding', 'block' or 'head' for planning layer `index`."""
        if not 0 <= index < self.num_layers:
            raise ValueError(f"layer index {index} outside [0, {self.num_layers})")
        if index == 0:
            return "embedding"
        if index == self.num_layers - 1:
            return "head"
        return "block"

    def layer_param_count(self, index: int) -> int:
        """Number of (full) parameters of planning layer `index`."""
        kind = self.layer_kind(index)
        d = self.d_model
        if kind == "embedding":
            return self.vocab_size * d + self.seq_len * d
        if kind == "head":
            return 2 * d + self.vocab_size * d  # final LayerNorm + untied head (no bias)
        # ln1 + qkv + proj + ln2 + fc + fc_proj
        return 2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * d + (d * self.d_ff + self.d_ff) + (self.d_ff * d + d)

    def num_params(self) -> int:
        return sum(self.layer_param_count(i) for i in range(self.num_layers))

    def layer_flops_per_token(self, index: int) -> float:
        """Forward FLOPs per token of planning layer `index` (2 per multiply-add)."""
        kind = self.layer_kind(index)
        d = self.d_model
        if kind == "embedding":
            return 0.0
        if kind == "head":
            return 2.0 * d * self.vocab_size
        matmul = 2.0 * (3 * d * d + d * d + 2 * d * self.d_ff)
        return matmul + self.core_flops_per_token()

    def core_flops_per_token(self) -> float:
        """Forward FLOPs per token of a block's attention core (scores and weighted sum, full
        non-causal count): what `selective` recomputation runs again."""
        return 2.0 * 2 * self.seq_len * self.d_model

    def with_overrides(self, **changes: object) -> GPTConfig:
        return replace(self, **changes)  # type: ignore[arg-type]

    def as_dict(self) -> dict[str, int | float]:
        """The fields as a JSON-ready object (what `--model-config` files hold)."""
        return dataclasses.asdict(self)

    def check_tensor_parallel(self, degree: int, *, by: str | None = None) -> None:
        """ValueError unless `degree` tensor-parallel ranks can split this shape (heads and vocabulary);
        `by` names the degree in the message (default "the tensor-parallel degree N")."""
        for what, size in (("n_head", self.n_head), ("vocab_size", self.vocab_size)):
            tp_split(size, degree, what, by=by)


def tp_split(value: int, degree: int, what: str, *, by: str | None = None) -> int:
    """`value` / `degree`, the share of each of `degree` tensor-parallel ranks: the one check
    that a size splits evenly. ValueError naming `what` unless it divides; `by` names the
    degree in the message (default "the tensor-parallel degree N")."""
    if value % degree:
        raise ValueError(f"{what}={value} is not divisible by {by or f'the tensor-parallel degree {degree}'}")
    return value // degree


PRESETS: dict[str, GPTConfig] = {
    # ~0.86M parameters, byte-level vocabulary: for tests.
    "tiny": GPTConfig(vocab_size=256, seq_len=64, n_layer=4, n_head=4, d_model=128),
    # ~25M parameters.
    "small": GPTConfig(vocab_size=256, seq_len=256, n_layer=8, n_head=8, d_model=512),
    # GPT-2 small shape (vocabulary padded to a multiple of 128).
    "gpt2-124m": GPTConfig(vocab_size=50304, seq_len=1024, n_layer=12, n_head=12, d_model=768),
    # GPT-3 family shapes (Brown et al. 2020, Table 2.1); for planning and simulation.
    "gpt3-350m": GPTConfig(vocab_size=50304, seq_len=2048, n_layer=24, n_head=16, d_model=1024),
    "gpt3-1.3b": GPTConfig(vocab_size=50304, seq_len=2048, n_layer=24, n_head=16, d_model=2048),
    "gpt3-2.7b": GPTConfig(vocab_size=50304, seq_len=2048, n_layer=32, n_head=32, d_model=2560),
    "gpt3-6.7b": GPTConfig(vocab_size=50304, seq_len=2048, n_layer=32, n_head=32, d_model=4096),
}


def get_preset(name: str) -> GPTConfig:
    """The preset called `name`; ValueError listing the known names otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        known = ", ".join(PRESETS)
        raise ValueError(f"unknown model preset {name!r}; known presets: {known}") from None


SHAPE_FIELDS: tuple[str, ...] = ("vocab_size", "seq_len", "n_layer", "n_head", "d_model")
"""The GPTConfig fields the command line can override one by one (--vocab-size, --seq-len, ...)."""


def config_from_dict(data: object, *, base: GPTConfig, where: str) -> GPTConfig:
    """`base` with the fields named in `data` (a JSON object of GPTConfig fields) replaced.

    ValueError naming `where` for anything but an object, an unknown field, a value of the
    wrong type or an impossible shape (non-positive sizes, d_model not divisible by n_head).
    """
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: expected a JSON object of GPTConfig fields, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(GPTConfig)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(map(repr, unknown))}; known: {', '.join(fields)}")
    changes: dict[str, object] = {}
    for name, value in data.items():
        floating = name == "dropout"
        ok = isinstance(value, (int, float) if floating else int) and not isinstance(value, bool)
        if not ok:
            raise ValueError(f"{where}: {name} must be {'a number' if floating else 'an integer'}, got {value!r}")
        changes[name] = float(value) if floating else value
    try:
        return base.with_overrides(**changes)
    except ValueError as exc:  # __post_init__: non-positive sizes, heads that do not divide the width
        raise ValueError(f"{where}: {exc}") from None


def read_config_file(path: str | Path) -> dict[str, object]:
    """The JSON object of a `--model-config` file; ValueError naming the file when it is not one."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"cannot read model config {path}: {exc.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"model config {path}: not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"model config {path}: expected a JSON object of GPTConfig fields, got {type(data).__name__}")
    return data


def describe_model(preset: str, cfg: GPTConfig) -> str:
    """A short name for a model: the preset's name, followed by the fields that differ from it."""
    base = get_preset(preset)
    changed = [f"{k}={v}" for k, v in cfg.as_dict().items() if getattr(base, k) != v]
    return preset if not changed else f"{preset} ({', '.join(changed)})"
