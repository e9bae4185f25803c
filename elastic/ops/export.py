"""This project's GPT as a Hugging Face `transformers` GPT-2 checkpoint (`elastic export --format hf`;
the Llama family's model is written as a LlamaForCausalLM: elastic/ops/hf_llama.py).

What is written: `config.json` (a `GPT2Config`, `architectures: ["GPT2LMHeadModel"]`),
`model.safetensors` (fp32) and, when the run's data came with one, `tokenizer.json`. Only
`safetensors` is needed to write it; `transformers` reads it (`GPT2LMHeadModel.from_pretrained`).

The architectures agree (elastic/model/gpt.py vs transformers' modeling_gpt2.py), so the
logits are the same function:

| here | GPT2LMHeadModel |
| --- | --- |
| learned positions `embed.wpe` (seq_len, d) | `transformer.wpe.weight`, n_positions = seq_len |
| pre-LayerNorm blocks, eps 1e-5, with biases | `ln_1`/`ln_2`, layer_norm_epsilon 1e-5 |
| fused qkv, rows head-major (n_head, 3, head_dim), Linear (out, in) | `c_attn`, Conv1D (in, out), columns (3, n_head, head_dim): permuted and transposed |
| attention scaled by 1/sqrt(head_dim), causal | scale_attn_weights, not by layer index, no upcast reordering |
| MLP 4x, GELU tanh approximation, with biases | n_inner 4d, activation `gelu_pytorch_tanh` (the same op) |
| final LayerNorm + untied head, no bias | `ln_f`, `lm_head.weight` with tie_word_embeddings = False |

What does not carry over: dropout here draws its masks from (seed, step key, site) so that any
TP degree and stage split drop the same units; transformers draws from torch's generator. The
dropout rates are exported (resid/embd/attn_pdrop), so training from the export is GPT-2 training
with them, but not a bit-identical continuation. Inference (dropout off) is the same. The
vocabulary is the model's (`vocab_size`, possibly padded past the tokenizer's); a byte-level run
has no tokenizer to export (token id = byte value). GPT-2's token ids 50256 (bos/eos) mean
nothing here: they are left out.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from elastic.model.config import GPTConfig
from elastic.model.gpt import GPTStage
from elastic.ops.hf_llama import hf_llama_config, to_hf_llama

LAYER_NORM_EPS = 1e-5
"""elastic/model/gpt.py's LayerNorm epsilon."""


class ExportError(ValueError):
    """The model or state cannot be represented as a GPT-2 checkpoint (one line for the user)."""


def hf_gpt2_config(cfg: GPTConfig) -> dict[str, Any]:
    """The `config.json` of a GPT2LMHeadModel with `cfg`'s shape (module doc)."""
    if cfg.d_ff != 4 * cfg.d_model:
        raise ExportError(f"an MLP of width {cfg.d_ff} (not 4 x d_model) has no GPT-2 form here")
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.seq_len,
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": cfg.d_ff,
        "activation_function": "gelu_pytorch_tanh",
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "layer_norm_epsilon": LAYER_NORM_EPS,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": None,
        "eos_token_id": None,
        "use_cache": True,
        "dtype": "float32",
    }


def _qkv_rows_to_hf(t: torch.Tensor, cfg: GPTConfig) -> torch.Tensor:
    """Fused qkv rows from head-major (n_head, 3, head_dim) to GPT-2's (3, n_head, head_dim)."""
    rest = t.shape[1:]
    heads = t.reshape(cfg.n_head, 3, cfg.head_dim, *rest)  # (n_head, 3, head_dim, ...)
    return heads.transpose(0, 1).reshape(3 * cfg.d_model, *rest)  # (3 * d_model, ...)


def _check_state(state: dict[str, torch.Tensor], cfg: GPTConfig) -> None:
    """ExportError unless `state` is exactly the parameters of model `cfg`."""
    with torch.device("meta"):
        expected = {n: tuple(p.shape) for n, p in GPTStage(cfg, initialise=False).named_parameters()}
    got = {n: tuple(t.shape) for n, t in state.items()}
    if got != expected:
        odd = sorted(n for n in got.keys() | expected.keys() if got.get(n) != expected.get(n))
        raise ExportError(f"the state does not fit model {cfg}: parameters {odd[:4]} differ in name or shape")


def to_hf_gpt2(s: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """GPT2LMHeadModel's state dict from canonical names -> full tensors (contiguous); `s` is the
    model's state, checked and in fp32 (`write_hf`)."""
    out = {
        "transformer.wte.weight": s["embed.wte.weight"],
        "transformer.wpe.weight": s["embed.wpe"],
        "transformer.ln_f.weight": s["head.ln_f.weight"],
        "transformer.ln_f.bias": s["head.ln_f.bias"],
    }
    if not cfg.tie_embeddings:  # tied: transformers reads the head from the embedding
        out["lm_head.weight"] = s["head.lm_head.weight"]
    for k in range(cfg.n_layer):
        ours, hf = f"blocks.{k}.", f"transformer.h.{k}."
        out.update({
            hf + "ln_1.weight": s[ours + "ln1.weight"],
            hf + "ln_1.bias": s[ours + "ln1.bias"],
            # Conv1D holds (in, out): the transpose of a Linear's (out, in).
            hf + "attn.c_attn.weight": _qkv_rows_to_hf(s[ours + "attn.qkv.weight"], cfg).t(),
            hf + "attn.c_attn.bias": _qkv_rows_to_hf(s[ours + "attn.qkv.bias"], cfg),
            hf + "attn.c_proj.weight": s[ours + "attn.proj.weight"].t(),
            hf + "attn.c_proj.bias": s[ours + "attn.proj.bias"],
            hf + "ln_2.weight": s[ours + "ln2.weight"],
            hf + "ln_2.bias": s[ours + "ln2.bias"],
            hf + "mlp.c_fc.weight": s[ours + "mlp.fc.weight"].t(),
            hf + "mlp.c_fc.bias": s[ours + "mlp.fc.bias"],
            hf + "mlp.c_proj.weight": s[ours + "mlp.proj.weight"].t(),
            hf + "mlp.c_proj.bias": s[ours + "mlp.proj.bias"],
        })
    return {n: t.contiguous() for n, t in out.items()}


def write_hf(out: Path, state: dict[str, torch.Tensor], cfg: GPTConfig, *, tokenizer: Path | None,
             source: str) -> list[Path]:
    """Write `config.json`, `model.safetensors` (and a copy of `tokenizer`) into `out`: a
    GPT2LMHeadModel, or for `arch = "llama"` a LlamaForCausalLM (elastic/ops/hf_llama.py); the
    files written. `source` (e.g. "runs/demo, final state") goes into the safetensors metadata."""
    from safetensors.torch import save_file

    _check_state(state, cfg)  # ExportError unless `state` is exactly this model's parameters
    full = {n: t.detach().float() for n, t in state.items()}
    if cfg.arch == "llama":
        config, tensors = hf_llama_config(cfg), to_hf_llama(full, cfg)
    else:
        config, tensors = hf_gpt2_config(cfg), to_hf_gpt2(full, cfg)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "config.json", out / "model.safetensors"]
    written[0].write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(written[1]), metadata={"format": "pt", "source": source})
    if tokenizer is not None:
        written.append(out / "tokenizer.json")
        shutil.copyfile(tokenizer, written[-1])
    return written
