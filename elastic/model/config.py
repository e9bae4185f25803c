"""GPT configuration and named presets.

Two architectures (`arch`), both with an untied output head (so that embedding and head may live
on different pipeline stages without a cross-stage weight tie):

- `gpt2`: learned positions, pre-LayerNorm blocks with biases, a GELU MLP of 4x width,
  multi-head attention (model/gpt.py);
- `llama`: the Llama family's decoder (model/llama.py): RMSNorm, rotary position embeddings of
  base `rope_theta`, a SwiGLU MLP of `ffn_hidden` and grouped-query attention over `n_kv_heads`
  key/value heads, no biases.
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
    arch: str = "gpt2"
    """`gpt2` or `llama` (module doc)."""
    n_kv_heads: int = 0
    """Key/value heads of grouped-query attention (`llama`); 0: as many as `n_head`."""
    rope_theta: float = 10000.0
    """Base of the rotary position embeddings (`llama`)."""
    ffn_hidden: int = 0
    """Hidden width of the MLP; 0: 4 x d_model (`gpt2`), or Llama's 8/3 x d_model rounded up to
    a multiple of 256 (`llama`)."""
    norm_eps: float = 1e-5
    """Epsilon of the norms (LayerNorm, RMSNorm)."""
    rope_factor: float = 0.0
    """Llama 3.1's rotary frequency scaling (`llama`): 0, none; else the factor the low
    frequencies are divided by, with `rope_low_freq_factor`, `rope_high_freq_factor` and
    `rope_original_context` placing the smooth band between (model/llama.py `rotary`)."""
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_context: int = 8192
    tie_embeddings: bool = False
    """One matrix for the token embedding and the output head (Llama 3.2 1B and 3B, GPT-2): the
    head's stage keeps a copy whose gradient is summed with the embedding's every step
    (elastic/parallel/tied.py)."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections (`llama`; Qwen2's attention), sharded with the
    fused q, k, v rows (model/kv_layout.py)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GPTConfig.{name} must be positive, got {getattr(self, name)}")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.arch not in ARCHS:
            raise ValueError(f"arch is one of {', '.join(ARCHS)}, got {self.arch!r}")
        if self.n_kv_heads < 0 or self.ffn_hidden < 0:
            raise ValueError(f"n_kv_heads and ffn_hidden must be >= 0 (0: the default), got {self.n_kv_heads}, "
                             f"{self.ffn_hidden}")
        if self.arch == "gpt2" and (self.n_kv_heads not in (0, self.n_head) or self.ffn_hidden not in (0, 4 * self.d_model)):
            raise ValueError("arch gpt2 has n_kv_heads = n_head and ffn_hidden = 4 x d_model; grouped-query "
                             "attention and other MLP widths are arch llama's")
        if self.n_head % self.kv_heads:
            raise ValueError(f"n_head={self.n_head} is not divisible by n_kv_heads={self.kv_heads}")
        if self.qkv_bias and self.arch != "llama":
            raise ValueError("qkv_bias is arch llama's (arch gpt2 has every bias)")
        if self.arch == "llama" and self.head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head_dim, got {self.head_dim}")
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise ValueError(f"rope_theta and norm_eps must be positive, got {self.rope_theta}, {self.norm_eps}")
        if self.rope_factor and (self.rope_factor < 1 or self.rope_original_context <= 0
                                 or not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor):
            raise ValueError("rope scaling needs rope_factor >= 1, rope_original_context > 0 and "
                             f"0 < rope_low_freq_factor < rope_high_freq_factor, got {self.rope_factor}, "
                             f"{self.rope_original_context}, {self.rope_low_freq_factor}, {self.rope_high_freq_factor}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_heads(self) -> int:
        """Key/value heads (`n_kv_heads`, or `n_head` where it is 0)."""
        return self.n_kv_heads or self.n_head

    @property
    def qkv_width(self) -> int:
        """Output width of the fused q, k, v projection: n_head + 2 x kv_heads heads."""
        return (self.n_head + 2 * self.kv_heads) * self.head_dim

    def qkv_rows(self, tp: int) -> int:
        """Rows of one tensor-parallel rank's fused q, k, v weight at degree `tp` (`qkv_shard_rows`)."""
        return qkv_shard_rows(self.kv_heads, self.n_head, self.head_dim, tp)

    @property
    def d_ff(self) -> int:
        if self.ffn_hidden:
            return self.ffn_hidden
        if self.arch == "llama":
            return -(-(8 * self.d_model // 3) // 256) * 256
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
        if self.arch == "llama":
            if kind == "embedding":
                return self.vocab_size * d
            if kind == "head":
                return d + self.vocab_size * d  # final RMSNorm + untied head
            # ln1 + qkv (+ its bias) + proj + ln2 + fc (gate and up) + proj (down)
            qkv = self.qkv_width * (d + 1 if self.qkv_bias else d)
            return d + qkv + d * d + d + 2 * self.d_ff * d + self.d_ff * d
        if kind == "embedding":
            return self.vocab_size * d + self.seq_len * d
        if kind == "head":
            return 2 * d + self.vocab_size * d  # final LayerNorm + untied head (no bias)
        # ln1 + qkv + proj + ln2 + fc + fc_proj
        return 2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * d + (d * self.d_ff + self.d_ff) + (self.d_ff * d + d)

    def num_params(self) -> int:
        """Parameters of the model (a tied matrix once; `layer_param_count` counts the head's copy)."""
        tied = self.vocab_size * self.d_model if self.tie_embeddings else 0
        return sum(self.layer_param_count(i) for i in range(self.num_layers)) - tied

    def layer_flops_per_token(self, index: int) -> float:
        """Forward FLOPs per token of planning layer `index` (2 per multiply-add)."""
        kind = self.layer_kind(index)
        d = self.d_model
        if kind == "embedding":
            return 0.0
        if kind == "head":
            return 2.0 * d * self.vocab_size
        mlp = (3 if self.arch == "llama" else 2) * d * self.d_ff  # SwiGLU: gate, up and down
        matmul = 2.0 * (self.qkv_width * d + d * d + mlp)
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
        if self.arch == "llama":  # whole key/value heads, or replicas of one (model/kv_layout.py)
            tp_split(self.d_ff, degree, "ffn_hidden", by=by)
            kv_replicas(self.kv_heads, self.n_head, degree, by=by)


def tp_split(value: int, degree: int, what: str, *, by: str | None = None) -> int:
    """`value` / `degree`, the share of each of `degree` tensor-parallel ranks: the one check
    that a size splits evenly. ValueError naming `what` unless it divides; `by` names the
    degree in the message (default "the tensor-parallel degree N")."""
    if value % degree:
        raise ValueError(f"{what}={value} is not divisible by {by or f'the tensor-parallel degree {degree}'}")
    return value // degree


def kv_replicas(kv_heads: int, n_head: int, degree: int, *, by: str | None = None) -> int:
    """Ranks that share each of `kv_heads` key/value heads at tensor-parallel degree `degree`: 1
    where the degree divides them, degree / kv_heads where they divide it (each replica then
    holding an equal part of the group's n_head / kv_heads query heads); ValueError otherwise."""
    if kv_heads % degree == 0:
        return 1
    if degree % kv_heads:
        raise ValueError(f"n_kv_heads={kv_heads} and {by or f'the tensor-parallel degree {degree}'} do not divide "
                         "one another (each rank holds whole key/value heads, or one shared by the same number of ranks)")
    tp_split(n_head, degree, "n_head", by=by)
    return degree // kv_heads


def qkv_shard_rows(kv_heads: int, n_head: int, head_dim: int, degree: int) -> int:
    """Rows of one of `degree` tensor-parallel ranks' fused q, k, v weight: its n_head / degree
    query heads and the key/value heads they use, whole or a replica of one (model/kv_layout.py)."""
    queries = n_head // kv_heads // kv_replicas(kv_heads, n_head, degree)
    return max(1, kv_heads // degree) * (queries + 2) * head_dim


ARCHS = ("gpt2", "llama")

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
    # Llama family (arch llama). llama-tiny and llama-small mirror tiny and small, with grouped-query
    # attention; the others are the published shapes (Llama 3.2 1B, with its rope scaling and tied
    # embeddings, and Llama 3 8B / 70B: head_dim 64 / 128, 8 KV heads, theta 500000, 128256-token
    # vocabulary), for planning and simulation.
    "llama-tiny": GPTConfig(arch="llama", vocab_size=256, seq_len=64, n_layer=4, n_head=8, n_kv_heads=4,
                            d_model=128, ffn_hidden=384),
    "llama-small": GPTConfig(arch="llama", vocab_size=256, seq_len=256, n_layer=8, n_head=8, n_kv_heads=4,
                             d_model=512, ffn_hidden=1536),
    "llama3.2-1b": GPTConfig(arch="llama", vocab_size=128256, seq_len=2048, n_layer=16, n_head=32, n_kv_heads=8,
                             d_model=2048, ffn_hidden=8192, rope_theta=500000.0, rope_factor=32.0,
                             tie_embeddings=True),
    "llama3-8b": GPTConfig(arch="llama", vocab_size=128256, seq_len=8192, n_layer=32, n_head=32, n_kv_heads=8,
                           d_model=4096, ffn_hidden=14336, rope_theta=500000.0),
    "llama3-70b": GPTConfig(arch="llama", vocab_size=128256, seq_len=8192, n_layer=80, n_head=64, n_kv_heads=8,
                            d_model=8192, ffn_hidden=28672, rope_theta=500000.0),
    # Qwen2.5 0.5B (a Llama with biases on q, k and v, tied, theta 1e6, 151936-token vocabulary;
    # 14 query heads and 2 key/value heads: tensor-parallel degree 1 or 2), at 4096 tokens.
    "qwen2.5-0.5b": GPTConfig(arch="llama", vocab_size=151936, seq_len=4096, n_layer=24, n_head=14, n_kv_heads=2,
                              d_model=896, ffn_hidden=4864, rope_theta=1e6, norm_eps=1e-6, tie_embeddings=True,
                              qkv_bias=True),
}


def get_preset(name: str) -> GPTConfig:
    """The preset called `name`; ValueError listing the known names otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        known = ", ".join(PRESETS)
        raise ValueError(f"unknown model preset {name!r}; known presets: {known}") from None


FLOAT_FIELDS = ("dropout", "rope_theta", "norm_eps", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor")
"""The GPTConfig fields that are numbers rather than integers (`arch` is a string, BOOL_FIELDS true
or false)."""
BOOL_FIELDS = ("tie_embeddings", "qkv_bias")

SHAPE_FIELDS: tuple[str, ...] = ("vocab_size", "seq_len", "n_layer", "n_head", "d_model", "n_kv_heads", "ffn_hidden")
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
        if name == "arch":
            if not isinstance(value, str):
                raise ValueError(f"{where}: arch must be a string ({', '.join(ARCHS)}), got {value!r}")
            changes[name] = value
            continue
        if name in BOOL_FIELDS:
            if not isinstance(value, bool):
                raise ValueError(f"{where}: {name} must be true or false, got {value!r}")
            changes[name] = value
            continue
        floating = name in FLOAT_FIELDS
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
