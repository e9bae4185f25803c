"""The Llama-family model (`arch = "llama"`, elastic/model/llama.py) as Hugging Face `transformers`'
`LlamaForCausalLM` tensors, or `Qwen2ForCausalLM`'s where `qkv_bias` (`to_hf_llama`, for `elastic
export --format hf`; the way in, slice by slice, is elastic/model/hf_import.py's).

| here | LlamaForCausalLM |
| --- | --- |
| `embed.wte.weight` | `model.embed_tokens.weight` |
| `blocks.k.ln1.weight`, `ln2.weight` (RMSNorm, eps `norm_eps`) | `model.layers.k.input_layernorm`, `post_attention_layernorm` |
| `blocks.k.attn.qkv.weight`, rows group-major (n_kv_heads, n_head / n_kv_heads + 2, head_dim); `attn.qkv.bias` alike (`qkv_bias`) | `self_attn.q_proj`, `k_proj`, `v_proj` (their biases: Qwen2) |
| `blocks.k.attn.proj.weight` | `self_attn.o_proj` |
| `blocks.k.mlp.fc.weight`, rows (ffn_hidden, 2): gate, up | `mlp.gate_proj`, `mlp.up_proj` |
| `blocks.k.mlp.proj.weight` | `mlp.down_proj` |
| `head.ln_f.weight`, `head.lm_head.weight` | `model.norm.weight`, `lm_head.weight` (none where `tie_embeddings`: tie_word_embeddings) |

Rotary embeddings: rotate-half, `rope_theta`, and Llama 3.1's `llama3` frequency scaling where
`rope_factor` is set (`rope_scaling` none otherwise). Attention and MLP
have no biases (`attention_bias`, `mlp_bias` false), but Qwen2's on q, k and v (`qkv_bias`:
model_type qwen2, no sliding window).
"""

from __future__ import annotations

from typing import Any

import torch

from elastic.model.config import GPTConfig


class HfLlamaError(ValueError):
    """The config does not fit the model (one line for the user)."""


def hf_llama_config(cfg: GPTConfig) -> dict[str, Any]:
    """The `config.json` of a LlamaForCausalLM with `cfg`'s shape."""
    if cfg.arch != "llama":
        raise HfLlamaError(f"model arch {cfg.arch!r} has no LlamaForCausalLM form")
    if cfg.qkv_bias and cfg.rope_factor:
        raise HfLlamaError("a model with qkv biases (Qwen2) and Llama 3.1's rope scaling has no transformers form")
    qwen = {"use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.n_layer}
    return {
        "architectures": ["Qwen2ForCausalLM" if cfg.qkv_bias else "LlamaForCausalLM"],
        "model_type": "qwen2" if cfg.qkv_bias else "llama",
        **(qwen if cfg.qkv_bias else {}),
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.seq_len,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None if not cfg.rope_factor else {
            "rope_type": "llama3", "factor": cfg.rope_factor, "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor, "original_max_position_embeddings": cfg.rope_original_context},
        "rms_norm_eps": cfg.norm_eps,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": cfg.dropout,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": 0.02,
        "bos_token_id": None,
        "eos_token_id": None,
        "use_cache": True,
        "dtype": "float32",
    }


def _split_qkv(qkv: torch.Tensor, cfg: GPTConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k and v of a fused qkv weight (rows, d_model) or bias (rows,)."""
    hd, groups, rest = cfg.head_dim, cfg.kv_heads, qkv.shape[1:]
    rep = cfg.n_head // groups
    grouped = qkv.reshape(groups, rep + 2, hd, *rest)
    return (grouped[:, :rep].reshape(cfg.n_head * hd, *rest), grouped[:, rep].reshape(groups * hd, *rest),
            grouped[:, rep + 1].reshape(groups * hd, *rest))


def _names(cfg: GPTConfig) -> list[tuple[str, str]]:
    """(ours, transformers') for every tensor that maps one to one."""
    pairs = [("embed.wte.weight", "model.embed_tokens.weight"), ("head.ln_f.weight", "model.norm.weight")]
    if not cfg.tie_embeddings:  # tied: transformers reads the head from the embedding
        pairs.append(("head.lm_head.weight", "lm_head.weight"))
    for k in range(cfg.n_layer):
        ours, hf = f"blocks.{k}.", f"model.layers.{k}."
        pairs += [(ours + "ln1.weight", hf + "input_layernorm.weight"),
                  (ours + "ln2.weight", hf + "post_attention_layernorm.weight"),
                  (ours + "attn.proj.weight", hf + "self_attn.o_proj.weight"),
                  (ours + "mlp.proj.weight", hf + "mlp.down_proj.weight")]
    return pairs


def to_hf_llama(state: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """LlamaForCausalLM's state dict from canonical names -> full tensors (contiguous)."""
    out = {hf: state[ours] for ours, hf in _names(cfg)}
    for k in range(cfg.n_layer):
        ours, hf = f"blocks.{k}.", f"model.layers.{k}.self_attn."
        q, kk, v = _split_qkv(state[ours + "attn.qkv.weight"], cfg)
        out.update({hf + "q_proj.weight": q, hf + "k_proj.weight": kk, hf + "v_proj.weight": v})
        if cfg.qkv_bias:
            q, kk, v = _split_qkv(state[ours + "attn.qkv.bias"], cfg)
            out.update({hf + "q_proj.bias": q, hf + "k_proj.bias": kk, hf + "v_proj.bias": v})
        both = state[ours + "mlp.fc.weight"].reshape(cfg.d_ff, 2, cfg.d_model)
        out[f"model.layers.{k}.mlp.gate_proj.weight"] = both[:, 0]
        out[f"model.layers.{k}.mlp.up_proj.weight"] = both[:, 1]
    return {n: t.detach().contiguous() for n, t in out.items()}
