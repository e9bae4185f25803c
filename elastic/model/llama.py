"""The Llama family's decoder (`arch = "llama"`), as planning layers like GPT-2's (model/gpt.py).

Planning layers: 0 = token embedding (no positions), 1..n_layer = blocks (pre-RMSNorm grouped-
query attention with rotary embeddings, pre-RMSNorm SwiGLU MLP, no biases but Qwen2's on q, k
and v where `qkv_bias`), n_layer+1 = final
RMSNorm + untied output head. The parameter names are GPT-2's where the part is the same
(`embed.wte`, `blocks.<k>.ln1`, `attn.qkv`, `attn.proj`, `ln2`, `mlp.fc`, `mlp.proj`,
`head.ln_f`, `head.lm_head`), so naming, initialisation, checkpoints and shard transfer need
nothing of their own.

Two fused layouts keep each tensor-parallel rank's share one row range, whatever the degree t
(which must divide ffn_hidden, and divide n_kv_heads or be a multiple of it):

- `attn.qkv` rows are group-major: for each of the n_kv_heads key/value groups, its n_head /
  n_kv_heads query heads, then its key head, then its value head (each head_dim rows). Query head
  h belongs to group h // (n_head / n_kv_heads), as in Hugging Face's `repeat_kv`. Where t
  exceeds n_kv_heads, t / n_kv_heads ranks share each key/value head, each with its part of the
  group's queries, and sum the head's gradient (model/kv_layout.py). A qkv bias (Qwen2) has the
  weight's rows, and its shared key/value rows' gradient is summed likewise.
- `mlp.fc` rows interleave the gate and up projections: row 2i is gate unit i, row 2i+1 up unit i.

Rotary embeddings use the rotate-half convention (Hugging Face's Llama), with inverse
frequencies and angles computed in fp32 whatever the compute dtype, as it does. Dropout (the
same sites as GPT-2's), recomputation and sequence parallelism follow model/gpt.py's module doc.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from elastic.model.collectives import copy_params_to_tp
from elastic.model.config import GPTConfig
from elastic.model.dropout import apply_dropout, dropout_mask
from elastic.model.kv_layout import KvGroups, sum_replica_grads
from elastic.model.tensor_parallel import TensorParallel
from elastic.model.tp_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    sharded_parameter,
)


def seq_shard(tp: TensorParallel, sequence_parallel: bool) -> tuple[int, int]:
    """(rank, shards) of the sequence a rank holds between tensor-parallel regions."""
    return (tp.rank, tp.size) if sequence_parallel else (0, 1)


def recomputing(mode: str, wanted: str) -> bool:
    """Whether to checkpoint here: `mode` is `wanted` and autograd records (not in evaluation)."""
    return mode == wanted and torch.is_grad_enabled()


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension (weight only), replicated on every tensor-parallel rank."""

    def __init__(self, dim: int, *, eps: float, tp: TensorParallel) -> None:
        super().__init__()
        self.eps = eps
        self.weight = sharded_parameter((dim,), None, tp)

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """`weight`: a stand-in for the weight (its sequence-parallel copy, `copy_params_to_tp`)."""
        return F.rms_norm(x, (x.shape[-1],), self.weight if weight is None else weight, eps=self.eps)


def inverse_frequencies(cfg: GPTConfig, device: torch.device) -> torch.Tensor:
    """The rotary inverse frequencies (head_dim / 2, fp32), with Llama 3.1's scaling where
    `rope_factor` is set: wavelengths under rope_original_context / rope_high_freq_factor kept,
    over rope_original_context / rope_low_freq_factor divided by the factor, the band between
    interpolated (as transformers' `llama3` rope type computes them)."""
    hd = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64, device=device).float() / hd))
    if not cfg.rope_factor:
        return inv_freq
    factor, low, high, context = (cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
                                  cfg.rope_original_context)
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < context / high) * ~(wavelen > context / low)
    return torch.where(medium, smoothed, scaled)


@functools.lru_cache(maxsize=16)
def rotary(cfg: GPTConfig, seq: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of the rotary angles of positions [0, seq), each (seq, head_dim): computed in
    fp32 (as transformers does), then cast to `dtype`. One table per shape, device and dtype,
    shared by every layer and microbatch: a constant, not an activation."""
    inv_freq = inverse_frequencies(cfg, device)
    angles = torch.outer(torch.arange(seq, device=device).float(), inv_freq)
    both = torch.cat((angles, angles), dim=-1)
    return both.cos().to(dtype), both.sin().to(dtype)


def _turn(x: torch.Tensor) -> torch.Tensor:
    """The rotate-half partner of x: (-x2, x1) of its halves."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _turn_back(x: torch.Tensor) -> torch.Tensor:
    """The transpose of `_turn`: (x2, -x1)."""
    half = x.shape[-1] // 2
    return torch.cat((x[..., half:], -x[..., :half]), dim=-1)


class _Rotate(torch.autograd.Function):
    """x cos + turn(x) sin, keeping nothing for the backward but the shared tables (a rotation's
    gradient is the inverse rotation: g cos + turn^T(g sin))."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.tables = (cos, sin)
        return x * cos + _turn(x) * sin

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.tables
        return grad * cos + _turn_back(grad * sin), None, None


def rotate(x: torch.Tensor, cfg: GPTConfig) -> torch.Tensor:
    """x (batch, heads, seq, head_dim) rotated by its positions' angles (rotate-half convention)."""
    cos, sin = rotary(cfg, x.shape[-2], x.device, x.dtype)
    return _Rotate.apply(x, cos, sin)


class LlamaAttention(nn.Module):
    """Causal grouped-query self-attention; this rank computes n_kv_heads / tp of the groups, or
    its part of one group's queries where ranks share a key/value head."""

    def __init__(self, cfg: GPTConfig, *, tp: TensorParallel, site: str, recompute: str = "none",
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.cfg, self.tp, self.site, self.recompute = cfg, tp, site, recompute
        self.layout = KvGroups.of(cfg)
        self.local_groups = self.layout.local_groups(tp.size)
        self.group_size = self.layout.local_queries(tp.size)
        self.local_heads = self.local_groups * self.group_size
        self.qkv = ColumnParallelLinear(cfg.d_model, cfg.qkv_width, tp=tp, bias=cfg.qkv_bias,
                                        sequence_parallel=sequence_parallel, layout=self.layout)
        self.proj = RowParallelLinear(cfg.d_model, cfg.d_model, tp=tp, bias=False, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor, key: int) -> torch.Tensor:
        bias = None if self.qkv.bias is None else sum_replica_grads(self.qkv.bias, self.layout, self.tp)
        qkv = self.qkv(x, sum_replica_grads(self.qkv.weight, self.layout, self.tp), bias)  # (batch, seq, local qkv width)
        if recomputing(self.recompute, "selective"):
            y = checkpoint(self.core, qkv, key, use_reentrant=False)
        else:
            y = self.core(qkv, key)
        return self.proj(y)

    def core(self, qkv: torch.Tensor, key: int) -> torch.Tensor:
        """Rotary embeddings and this rank's heads' attention, dropout included (what `selective`
        recomputation runs again)."""
        batch, seq, _ = qkv.shape
        hd, rep, groups = self.cfg.head_dim, self.group_size, self.local_groups
        grouped = qkv.view(batch, seq, groups, rep + 2, hd)
        q = grouped[:, :, :, :rep].reshape(batch, seq, groups * rep, hd).transpose(1, 2)  # (batch, heads, seq, hd)
        k = grouped[:, :, :, rep].transpose(1, 2)  # (batch, groups, seq, hd)
        v = grouped[:, :, :, rep + 1].transpose(1, 2)
        q, k = rotate(q, self.cfg), rotate(k, self.cfg)
        p = self.cfg.dropout if self.training else 0.0
        if p == 0.0:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=rep > 1)
        else:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
            causal = torch.full((seq, seq), float("-inf"), dtype=scores.dtype, device=qkv.device).triu(1)
            probs = (scores + causal).softmax(dim=-1)
            full = dropout_mask((batch, self.cfg.n_head, seq, seq), p, seed=self.cfg.init_seed, key=key,
                                site=f"{self.site}.attn", device=qkv.device)
            heads = slice(self.tp.rank * self.local_heads, (self.tp.rank + 1) * self.local_heads)
            mask = full[:, heads].clone() if self.tp.size > 1 else full
            y = (probs * mask.to(probs.dtype)) @ v
        return y.transpose(1, 2).reshape(batch, seq, self.local_heads * hd)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)); gate and up fused in one column-parallel layer (module doc)."""

    def __init__(self, cfg: GPTConfig, *, tp: TensorParallel, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.fc = ColumnParallelLinear(cfg.d_model, 2 * cfg.d_ff, tp=tp, bias=False, sequence_parallel=sequence_parallel)
        self.proj = RowParallelLinear(cfg.d_ff, cfg.d_model, tp=tp, bias=False, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        both = self.fc(x)
        both = both.view(*both.shape[:-1], -1, 2)
        return self.proj(F.silu(both[..., 0]) * both[..., 1])


class LlamaEmbedding(nn.Module):
    """Planning layer 0: the vocab-parallel token embedding (positions are rotary, in attention)."""

    def __init__(self, cfg: GPTConfig, *, tp: TensorParallel, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.cfg, self.shard = cfg, seq_shard(tp, sequence_parallel)
        self.wte = VocabParallelEmbedding(cfg.vocab_size, cfg.d_model, tp=tp, sequence_parallel=sequence_parallel)

    def forward(self, tokens: torch.Tensor, key: int) -> torch.Tensor:
        if tokens.shape[1] > self.cfg.seq_len:
            raise ValueError(f"sequence of {tokens.shape[1]} tokens exceeds the model's seq_len={self.cfg.seq_len}")
        return apply_dropout(self.wte(tokens), self.cfg.dropout, seed=self.cfg.init_seed, key=key, site="embed",
                             training=self.training, seq_shard=self.shard)


class LlamaBlock(nn.Module):
    """Pre-RMSNorm block: x + attn(norm(x)), then + mlp(norm(.)) (planning layers 1..n_layer)."""

    def __init__(self, cfg: GPTConfig, *, tp: TensorParallel, site: str, recompute: str = "none",
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.cfg, self.site, self.tp = cfg, site, tp
        self.sequence_parallel, self.shard = sequence_parallel, seq_shard(tp, sequence_parallel)
        self.ln1 = RMSNorm(cfg.d_model, eps=cfg.norm_eps, tp=tp)
        self.attn = LlamaAttention(cfg, tp=tp, site=site, recompute=recompute, sequence_parallel=sequence_parallel)
        self.ln2 = RMSNorm(cfg.d_model, eps=cfg.norm_eps, tp=tp)
        self.mlp = SwiGLU(cfg, tp=tp, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor, key: int) -> torch.Tensor:
        p, seed, training, shard = self.cfg.dropout, self.cfg.init_seed, self.training, self.shard
        w1 = w2 = None
        if self.sequence_parallel:  # the norms' weights used on my shard: one gradient sum
            w1, w2 = copy_params_to_tp(self.tp, self.ln1.weight, self.ln2.weight)
        x = x + apply_dropout(self.attn(self.ln1(x, w1), key), p, seed=seed, key=key, site=f"{self.site}.res1",
                              training=training, seq_shard=shard)
        return x + apply_dropout(self.mlp(self.ln2(x, w2)), p, seed=seed, key=key, site=f"{self.site}.res2",
                                 training=training, seq_shard=shard)


class LlamaHead(nn.Module):
    """Last planning layer: final RMSNorm + untied output projection (vocab-sharded logits)."""

    def __init__(self, cfg: GPTConfig, *, tp: TensorParallel, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.tp, self.sequence_parallel = tp, sequence_parallel
        self.ln_f = RMSNorm(cfg.d_model, eps=cfg.norm_eps, tp=tp)
        self.lm_head = ColumnParallelLinear(cfg.d_model, cfg.vocab_size, tp=tp, bias=False,
                                            sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = copy_params_to_tp(self.tp, self.ln_f.weight)[0] if self.sequence_parallel else None
        return self.lm_head(self.ln_f(x, weight))
