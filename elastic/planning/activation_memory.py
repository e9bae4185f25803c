"""Activation memory as the memory model counts it: what each planning layer keeps from its
forward to its backward per microbatch, in the compute dtype (fp32 on CPU, bf16 under the
engine's autocast on CUDA) and beside it in fp32 (the residual stream and LayerNorm statistics),
the bf16 weight copies autocast keeps, and the head's loss at its peak: the logits, their fp32
copy, the shifted logits, their exponentials and the softmax (`model/tp_layers.py`)."""

from __future__ import annotations

from dataclasses import dataclass

from elastic.model.config import GPTConfig
from elastic.planning.footprint import AUTOCAST_DEVICE_TYPES, LOW_PRECISION_BYTES, WEIGHT_BYTES


def compute_bytes(device_type: str) -> int:
    """Bytes of one activation element in the compute dtype on `device_type`."""
    return LOW_PRECISION_BYTES if device_type in AUTOCAST_DEVICE_TYPES else WEIGHT_BYTES


@dataclass(frozen=True, kw_only=True)
class Saved:
    """What one planning layer keeps from its forward to its backward, for one microbatch."""

    elements_per_token: float
    """Elements in the compute dtype."""
    bytes_per_token: float
    """Bytes whatever the compute dtype: fp32 residual stream and statistics, token ids, masks."""
    cast_params: int
    """Weight elements autocast copies to the compute dtype and keeps (none in fp32)."""
    workspace_per_token: float = 0.0
    """Elements per token the loss holds at its peak beyond them (the head), for `head_bytes`."""


def layer_saved(cfg: GPTConfig, index: int, tp: int = 1, recompute: str = "none",
                sequence_parallel: bool = False) -> Saved:
    """What planning layer `index` keeps per microbatch on one of `tp` ranks under `recompute`,
    sequence-parallel or not (model/gpt.py; measured on this model: saved-tensor hooks over one
    layer, fp32 and bf16 autocast, and over a real Trainer step).

    A block keeps in the compute dtype its two LayerNorm outputs (the column-parallel inputs) and
    its sharded q/k/v, attention output, MLP input and GELU output: 2d + 12d / tp elements; in
    fp32 its input and the residual after attention (2d), the LayerNorms' mean and rstd (4) and,
    when attention runs fused (no dropout), its log-sum-exp (n_head / tp). With dropout the
    attention core keeps instead its probabilities, their dropout mask and the masked product:
    3 x n_head x seq / tp elements in the compute dtype (as CPU autocast runs it; CUDA's keeps
    the first two in fp32, 4 more bytes each), and each residual dropout its fp32 mask (d). The
    head keeps its fp32 input and statistics and the LayerNorm output; the embedding its token
    ids (int64), the mask of ids outside this rank's vocabulary shard and, with dropout, its
    fp32 dropout mask.

    Recomputation changes only the blocks. `selective` drops what the attention core keeps for
    itself: the log-sum-exp of fused attention, or with dropout the probabilities (its input q, k,
    v and its output stay: the projections keep them). `full` keeps only the block's fp32 input
    (4d bytes); the block's activations live again, one block at a time, while its backward runs
    (`recompute_workspace`).

    Sequence parallelism (with tp > 1) splits what the LayerNorms and the residual stream keep
    along the sequence: the fp32 inputs and statistics by tp; and each column-parallel layer
    keeps its input shard as it came (the LayerNorm's fp32 output, d / tp per token) instead of
    the gathered input, so under autocast the qkv, MLP-input and head weights are not copied
    (their rerun in the backward casts in place: only the row-parallel weights' copies are kept).
    """
    d, kind = cfg.d_model, cfg.layer_kind(index)
    sp = tp if sequence_parallel and tp > 1 else 0  # 0: not sequence-parallel
    shard = sp or 1  # what the sequence-parallel regions are divided by
    dropped = 4.0 * d / shard if cfg.dropout > 0 else 0.0  # a residual-stream dropout's fp32 mask
    if kind == "block" and recompute == "full":
        return Saved(elements_per_token=0.0, bytes_per_token=4.0 * d / shard, cast_params=0)
    if kind == "embedding":
        return Saved(elements_per_token=0.0, bytes_per_token=8 + 1 + dropped, cast_params=0)
    if cfg.arch == "llama" and kind != "embedding":
        return _llama_saved(cfg, kind, tp, recompute, sp)
    if kind == "head":
        if sp:
            return Saved(elements_per_token=0.0, bytes_per_token=4.0 * (2 * d + 2) / sp, cast_params=0,
                         workspace_per_token=cfg.vocab_size / tp)
        return Saved(elements_per_token=float(d), bytes_per_token=4.0 * (d + 2), cast_params=cfg.vocab_size // tp * d,
                     workspace_per_token=cfg.vocab_size / tp)
    heads = cfg.n_head / tp
    core = recompute != "selective"  # the attention core's own activations are kept
    # With dropout the core keeps its softmax, its dropout mask and the masked product per head
    # and key, in the compute dtype (CPU autocast; CUDA's keeps the first two in fp32); fused
    # attention (no dropout) only its log-sum-exp.
    attention = 3.0 * heads * cfg.seq_len if cfg.dropout > 0 and core else 0.0
    fused = 4.0 * heads if cfg.dropout == 0 and core else 0.0
    extra = fused + 2 * dropped  # and the two residual dropouts' masks
    if sp:  # the LayerNorm outputs in fp32, sharded; only attn.proj's and mlp.proj's weights copied
        return Saved(elements_per_token=12.0 * d / tp + attention, bytes_per_token=4.0 * (4 * d + 4) / sp + extra,
                     cast_params=5 * d * d // tp)
    return Saved(elements_per_token=2.0 * d + 12.0 * d / tp + attention, bytes_per_token=4.0 * (2 * d + 4) + extra,
                 cast_params=12 * d * d // tp)


def _llama_saved(cfg: GPTConfig, kind: str, tp: int, recompute: str, sp: int) -> Saved:
    """`layer_saved` of a Llama-family block or head (model/llama.py; measured as GPT-2's are).

    Each RMSNorm keeps in fp32 its input, its normalised input (for the weight's gradient) and
    its rstd (2d + 1); the column-parallel layer after it, the norm's output (d in the compute
    dtype, or with sequence parallelism its fp32 shard). Attention keeps the fused q/k/v output
    (which the value heads are views of), the rotated queries and keys (the rotation itself
    keeps nothing: model/llama.py `_Rotate`), the output and the log-sum-exp (fp32); with
    dropout instead the rotated queries, the keys and values repeated to every query head, the
    probabilities, their mask, the masked product and the output (the fused q/k/v output is
    then not kept); under `selective` only the fused q/k/v output and the output. SwiGLU keeps
    the fused gate/up output (2f / tp), silu(gate) and the product (f / tp each); a residual
    dropout its mask in the compute dtype (no output bias widens the branch to fp32 as GPT-2's
    does). Everything else is GPT-2's: `full` keeps the block's fp32 input, the head the
    vocabulary-wide workspace of the loss."""
    d, f, shard = cfg.d_model, cfg.d_ff, sp or 1
    # a residual dropout's mask, in the compute dtype (GPT-2's output bias widens it to fp32; no bias here)
    dropped = d / shard if cfg.dropout > 0 else 0.0
    norm = 4.0 * (2 * d + 1)  # fp32: the input, the normalised input, rstd
    if kind == "head":
        if sp:
            return Saved(elements_per_token=0.0, bytes_per_token=(norm + 4.0 * d) / sp, cast_params=0,
                         workspace_per_token=cfg.vocab_size / tp)
        return Saved(elements_per_token=float(d), bytes_per_token=norm, cast_params=cfg.vocab_size // tp * d,
                     workspace_per_token=cfg.vocab_size / tp)
    if recompute == "full":
        return Saved(elements_per_token=0.0, bytes_per_token=4.0 * d / shard, cast_params=0)
    qkv = cfg.qkv_rows(tp)  # this rank's query heads and the key/value heads they use (whole where shared)
    heads, kv = cfg.n_head / tp, (qkv - cfg.d_model // tp) / 2
    fused = 4.0 * heads if cfg.dropout == 0 and recompute != "selective" else 0.0  # the log-sum-exp
    if recompute == "selective":
        attention = qkv + d / tp
    elif cfg.dropout > 0:
        attention = 4.0 * d / tp + 3.0 * heads * cfg.seq_len
    else:
        attention = qkv + 2.0 * d / tp + kv
    kept = attention + 4.0 * f / tp + 2 * dropped  # and SwiGLU's, and the residual dropouts' masks
    if sp:  # the norms' fp32 outputs sharded (the column-parallel inputs); only the row-parallel weights copied
        return Saved(elements_per_token=kept, bytes_per_token=2 * (norm + 4.0 * d) / sp + fused,
                     cast_params=(d + f) * d // tp)
    return Saved(elements_per_token=2.0 * d + kept, bytes_per_token=2 * norm + fused,
                 cast_params=(qkv + (d + 3 * f) // tp) * d)


def rerun_allreduces(recompute: str) -> int:
    """Tensor-parallel all-reduces a block's backward adds under `recompute`: `full` reruns the
    forward's two (`selective`'s attention core has none)."""
    return 2 if recompute == "full" else 0


def saved_bytes(saved: Saved, *, tokens: int, element_bytes: int) -> int:
    """Bytes `saved` amounts to for one microbatch of `tokens` tokens in `element_bytes` elements."""
    cast = saved.cast_params * element_bytes if element_bytes < WEIGHT_BYTES else 0
    return int(tokens * (saved.elements_per_token * element_bytes + saved.bytes_per_token)) + cast


def loss_bytes_per_element(element_bytes: int) -> int:
    """Bytes per logit at the loss's peak: the logits, their copy in the loss's dtype (fp32 at
    least; none when they have it), the shifted logits, their exponentials and the softmax."""
    loss = max(element_bytes, WEIGHT_BYTES)
    return element_bytes + (loss if loss != element_bytes else 0) + 3 * loss


def head_bytes(cfg: GPTConfig, *, tokens: int, tp: int = 1, element_bytes: int = WEIGHT_BYTES) -> int:
    """Bytes of the head's loss at its peak for one microbatch of `tokens` tokens."""
    return int(tokens * layer_saved(cfg, cfg.num_layers - 1, tp).workspace_per_token) * loss_bytes_per_element(
        element_bytes)


def recompute_workspace(cfg: GPTConfig, layers: tuple[int, int], *, tp: int, recompute: str, tokens: int,
                        element_bytes: int, sequence_parallel: bool = False) -> int:
    """Bytes that live again while a `full` stage's backward recomputes a block: one block's
    activations without recomputation, for one microbatch (0 in the other modes, or without a
    block in `layers`)."""
    first, last = layers
    blocks = [i for i in range(first, last) if cfg.layer_kind(i) == "block"]
    if recompute != "full" or not blocks:
        return 0
    return saved_bytes(layer_saved(cfg, blocks[0], tp, sequence_parallel=sequence_parallel), tokens=tokens,
                       element_bytes=element_bytes)
