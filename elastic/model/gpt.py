"""GPT-2 as an ordered list of planning layers, any contiguous range of which is a stage (and the
stage of either architecture, `GPTStage`: the Llama family's layers are model/llama.py's).

Planning layers: 0 = embedding (tokens + learned positions), 1..n_layer = transformer blocks
(pre-LayerNorm attention and 4x GELU MLP), n_layer+1 = final LayerNorm + output head.
Parameter names are canonical (`embed.*`, `blocks.<k>.*`, `head.*`) whatever stage holds them.
Tensor parallelism splits attention heads, the MLP's hidden width and the vocabulary.

Activation recomputation (`recompute`, per stage): `none` keeps every activation the backward
needs; `selective` keeps the attention core's input (q, k, v) and runs the core (scores, softmax,
dropout, the product with v) again in the backward (Korthikanti et al., 2022); `full` keeps only
each block's input and runs the whole block again (its tensor-parallel all-reduces with it).
Both use torch's non-reentrant checkpoint. Dropout masks depend only on (seed, key, site)
(model/dropout.py), so the recomputed forward draws the same masks and the gradients are the
same, bit for bit, in every mode.

Sequence parallelism (`sequence_parallel`, with tensor parallelism; Korthikanti et al., 2022):
between the tensor-parallel regions (the LayerNorms, the residual stream and its dropout) each
rank holds 1/tp of the sequence. The embedding reduce-scatters its vocabulary-parallel lookups
along the sequence, each column-parallel layer all-gathers its input shard, each row-parallel
layer reduce-scatters its output, and the stage's output (what crosses to the next stage) is
the rank's shard: (batch, seq / tp, d_model). A replicated parameter used on a shard (LayerNorm
weights and biases, row-parallel biases, positions) sums its gradient over the ranks. The same
function as without it (masks of the full activation, sliced), summed in another order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from elastic.model.collectives import copy_params_to_tp, copy_to_tp
from elastic.model.config import GPTConfig, check_recompute
from elastic.model.dropout import apply_dropout, dropout_mask
from elastic.model.init import full_initial_value, shard_tensor
from elastic.model.llama import LlamaBlock, LlamaEmbedding, LlamaHead, recomputing, seq_shard
from elastic.model.tensor_parallel import TensorParallel
from elastic.model.tp_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    sharded_parameter,
    vocab_parallel_cross_entropy,
)


class LayerNorm(nn.Module):
    """LayerNorm over the last dimension; replicated on every tensor-parallel rank (with
    sequence parallelism applied to the rank's sequence shard: its owner passes stand-ins whose
    gradients are summed over the ranks)."""

    def __init__(self, dim: int, *, tp: TensorParallel) -> None:
        super().__init__()
        self.weight = sharded_parameter((dim,), None, tp)
        self.bias = sharded_parameter((dim,), None, tp)

    def forward(self, x: torch.Tensor, params: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """`params`: (weight, bias) to use instead of the parameters themselves (their
        sequence-parallel stand-ins, `copy_params_to_tp`)."""
        weight, bias = params if params is not None else (self.weight, self.bias)
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps=1e-5)


class Embedding(nn.Module):
    """Planning layer 0: vocab-parallel token embedding + learned positions."""

    def __init__(self, cfg: GPTConfig, *, tp: TensorParallel, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.cfg, self.tp, self.sequence_parallel = cfg, tp, sequence_parallel
        self.wte = VocabParallelEmbedding(cfg.vocab_size, cfg.d_model, tp=tp, sequence_parallel=sequence_parallel)
        self.wpe = sharded_parameter((cfg.seq_len, cfg.d_model), None, tp)

    def forward(self, tokens: torch.Tensor, key: int) -> torch.Tensor:
        seq = tokens.shape[1]
        if seq > self.cfg.seq_len:
            raise ValueError(f"sequence of {seq} tokens exceeds the model's seq_len={self.cfg.seq_len}")
        positions = self.wpe[:seq]
        shard = seq_shard(self.tp, self.sequence_parallel)
        if self.sequence_parallel:  # this rank's positions; their gradient summed over the ranks
            width = self.tp.divide(seq, "sequence length")
            positions = copy_to_tp(positions, self.tp)[shard[0] * width:(shard[0] + 1) * width]
        x = self.wte(tokens) + positions  # (batch, seq [/ tp], d_model)
        return apply_dropout(x, self.cfg.dropout, seed=self.cfg.init_seed, key=key, site="embed", training=self.training,
                             seq_shard=shard)


class Attention(nn.Module):
    """Causal self-attention; this rank computes n_head / tp of the heads."""

    def __init__(self, cfg: GPTConfig, *, tp: TensorParallel, site: str, recompute: str = "none",
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.cfg, self.tp, self.site, self.recompute = cfg, tp, site, recompute
        self.local_heads = tp.divide(cfg.n_head, "n_head")
        # Full qkv rows are laid out head-major, (n_head, 3, head_dim), so a contiguous row slice
        # holds the q, k and v of this rank's heads.
        self.qkv = ColumnParallelLinear(cfg.d_model, 3 * cfg.d_model, tp=tp, sequence_parallel=sequence_parallel)
        self.proj = RowParallelLinear(cfg.d_model, cfg.d_model, tp=tp, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor, key: int, proj_bias: torch.Tensor | None = None) -> torch.Tensor:
        """`proj_bias`: the output projection's bias to use instead of its own (`RowParallelLinear`)."""
        qkv = self.qkv(x)  # (batch, seq, 3 x local width)
        if recomputing(self.recompute, "selective"):
            y = checkpoint(self.core, qkv, key, use_reentrant=False)
        else:
            y = self.core(qkv, key)
        return self.proj(y, proj_bias)

    def core(self, qkv: torch.Tensor, key: int) -> torch.Tensor:
        """The attention core: this rank's heads' softmax(q k^T / sqrt(d)) v, dropout included;
        what `selective` recomputation runs again (module doc)."""
        batch, seq, _ = qkv.shape
        hd = self.cfg.head_dim
        qkv = qkv.view(batch, seq, self.local_heads, 3, hd)  # (batch, seq, heads, 3, head_dim)
        q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))  # each (batch, heads, seq, head_dim)
        p = self.cfg.dropout if self.training else 0.0
        if p == 0.0:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(hd)  # (batch, heads, seq, seq)
            # -inf above the diagonal, added (an addition keeps nothing for its backward)
            causal = torch.full((seq, seq), float("-inf"), dtype=scores.dtype, device=qkv.device).triu(1)
            probs = (scores + causal).softmax(dim=-1)
            full = dropout_mask(
                (batch, self.cfg.n_head, seq, seq), p, seed=self.cfg.init_seed, key=key, site=f"{self.site}.attn", device=qkv.device
            )
            heads = slice(self.tp.rank * self.local_heads, (self.tp.rank + 1) * self.local_heads)
            mask = full[:, heads].clone() if self.tp.size > 1 else full  # the backward keeps my heads' only
            y = (probs * mask.to(probs.dtype)) @ v
        return y.transpose(1, 2).reshape(batch, seq, self.local_heads * hd)  # (batch, seq, local width)


class MLP(nn.Module):
    """GELU MLP of 4x width; the hidden width is split across tensor-parallel ranks."""

    def __init__(self, cfg: GPTConfig, *, tp: TensorParallel, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.fc = ColumnParallelLinear(cfg.d_model, cfg.d_ff, tp=tp, sequence_parallel=sequence_parallel)
        self.proj = RowParallelLinear(cfg.d_ff, cfg.d_model, tp=tp, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor, proj_bias: torch.Tensor | None = None) -> torch.Tensor:
        """`proj_bias`: the output projection's bias to use instead of its own (`RowParallelLinear`)."""
        return self.proj(F.gelu(self.fc(x), approximate="tanh"), proj_bias)


class Block(nn.Module):
    """Pre-LayerNorm transformer block (planning layers 1..n_layer)."""

    def __init__(self, cfg: GPTConfig, *, tp: TensorParallel, site: str, recompute: str = "none",
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.cfg, self.site = cfg, site
        self.shard = seq_shard(tp, sequence_parallel)
        self.tp, self.sequence_parallel = tp, sequence_parallel
        self.ln1 = LayerNorm(cfg.d_model, tp=tp)
        self.attn = Attention(cfg, tp=tp, site=site, recompute=recompute, sequence_parallel=sequence_parallel)
        self.ln2 = LayerNorm(cfg.d_model, tp=tp)
        self.mlp = MLP(cfg, tp=tp, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor, key: int) -> torch.Tensor:
        p, seed, training, shard = self.cfg.dropout, self.cfg.init_seed, self.training, self.shard
        ln1: tuple[torch.Tensor, torch.Tensor] | None = None
        ln2: tuple[torch.Tensor, torch.Tensor] | None = None
        bias1 = bias2 = None
        if self.sequence_parallel:  # the replicated parameters used on my shard: one gradient sum
            assert self.attn.proj.bias is not None and self.mlp.proj.bias is not None
            w1, b1, bias1, w2, b2, bias2 = copy_params_to_tp(
                self.tp, self.ln1.weight, self.ln1.bias, self.attn.proj.bias, self.ln2.weight, self.ln2.bias,
                self.mlp.proj.bias)
            ln1, ln2 = (w1, b1), (w2, b2)
        x = x + apply_dropout(self.attn(self.ln1(x, ln1), key, bias1), p, seed=seed, key=key,
                              site=f"{self.site}.res1", training=training, seq_shard=shard)
        return x + apply_dropout(self.mlp(self.ln2(x, ln2), bias2), p, seed=seed, key=key, site=f"{self.site}.res2",
                                 training=training, seq_shard=shard)


class Head(nn.Module):
    """Last planning layer: final LayerNorm + untied output projection (vocab-sharded logits)."""

    def __init__(self, cfg: GPTConfig, *, tp: TensorParallel, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.tp, self.sequence_parallel = tp, sequence_parallel
        self.ln_f = LayerNorm(cfg.d_model, tp=tp)
        self.lm_head = ColumnParallelLinear(cfg.d_model, cfg.vocab_size, tp=tp, bias=False,
                                            sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = copy_params_to_tp(self.tp, self.ln_f.weight, self.ln_f.bias) if self.sequence_parallel else None
        return self.lm_head(self.ln_f(x, params))  # (batch, seq, vocab / tp)


class GPTStage(nn.Module):
    """Planning layers [first, last) of a GPT, tensor-parallel over `tp`.

    forward(x): x is token ids (batch, seq) when first == 0, else hidden states
    (batch, seq, d_model); returns hidden states, or this rank's vocabulary shard of the
    logits when the stage ends with the head.
    """

    def __init__(
        self,
        cfg: GPTConfig,
        *,
        first: int = 0,
        last: int | None = None,
        tp: TensorParallel | None = None,
        device: torch.device | str | None = None,
        initialise: bool = True,
        recompute: str = "none",
        sequence_parallel: bool = False,
        chunks: Sequence[tuple[int, int]] = (),
    ) -> None:
        """`initialise=False` leaves the parameters unset (for a caller that fills every one,
        e.g. built under `torch.device("meta")` and then given kept or fetched tensors);
        `recompute`: what the backward recomputes; `sequence_parallel`: split the activations
        between the tensor-parallel regions along the sequence (module doc; nothing to split
        without tensor parallelism); `chunks`: the layer ranges of an interleaved stage's model
        chunks (instead of `first` and `last`), each run alone by `forward(..., chunk=c)`."""
        super().__init__()
        self.recompute = check_recompute(recompute)
        last = cfg.num_layers if last is None else last
        self.ranges = tuple(chunks) or ((first, last),)
        """The layer range of each model chunk (one without interleaving)."""
        for lo, hi in self.ranges:
            if not 0 <= lo < hi <= cfg.num_layers:
                raise ValueError(f"stage layers [{lo}, {hi}) are not a non-empty range of [0, {cfg.num_layers})")
        held = sorted(layer for lo, hi in self.ranges for layer in range(lo, hi))
        if len(set(held)) != len(held):
            raise ValueError(f"model chunks {list(self.ranges)} overlap")
        self.cfg, self.first, self.last = cfg, self.ranges[0][0], self.ranges[0][1]
        self.tp = tp or TensorParallel.single()
        cfg.check_tensor_parallel(self.tp.size)
        sp = self.sequence_parallel = sequence_parallel and self.tp.size > 1
        if sp:
            self.tp.divide(cfg.seq_len, "seq_len")
        self.seq_shards = self.tp.size if sp else 1
        """Shards of the sequence a stage's input and output activations are split into."""
        llama = cfg.arch == "llama"
        embedding, block, head = (LlamaEmbedding, LlamaBlock, LlamaHead) if llama else (Embedding, Block, Head)
        self.embed = embedding(cfg, tp=self.tp, sequence_parallel=sp) if held[0] == 0 else None
        block_ids = [layer - 1 for layer in held if 1 <= layer <= cfg.n_layer]
        self.blocks = nn.ModuleDict({str(k): block(cfg, tp=self.tp, site=f"blocks.{k}", recompute=recompute,
                                                   sequence_parallel=sp)
                                     for k in block_ids})
        self.head = head(cfg, tp=self.tp, sequence_parallel=sp) if held[-1] == cfg.num_layers - 1 else None
        if initialise:
            self._initialise()
        if device is not None:
            self.to(device)

    def _initialise(self) -> None:
        with torch.no_grad():
            for name, param in self.named_parameters():
                full = full_initial_value(name, param.full_shape, self.cfg)  # type: ignore[attr-defined]
                param.copy_(shard_tensor(full, param.tp_dim, self.tp.rank, self.tp.size,  # type: ignore[attr-defined]
                                         layout=param.tp_layout))  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor, *, dropout_key: int | None = None, chunk: int = 0) -> torch.Tensor:
        """Run model chunk `chunk`'s layers (the whole stage without interleaving)."""
        key = dropout_key if dropout_key is not None else int(torch.randint(0, 2**62, ()).item())
        lo, hi = self.ranges[chunk]
        if lo == 0 and self.embed is not None:
            x = self.embed(x, key)
        for k in range(max(lo, 1) - 1, min(hi, self.cfg.n_layer + 1) - 1):
            block = self.blocks[str(k)]
            x = checkpoint(block, x, key, use_reentrant=False) if recomputing(self.recompute, "full") else block(x, key)
        if hi == self.cfg.num_layers and self.head is not None:
            x = self.head(x)
        return x

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over every token of the batch, from vocabulary-sharded logits."""
        if self.head is None:
            raise ValueError(f"stage [{self.first}, {self.last}) has no head: it cannot compute a loss")
        return vocab_parallel_cross_entropy(logits, targets, self.tp).mean()
