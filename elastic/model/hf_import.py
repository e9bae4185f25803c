"""A Hugging Face model directory read in (`elastic run --init-from DIR`): `config.json` plus
`model.safetensors`, or its shards (`model.safetensors.index.json`), of a `GPT2LMHeadModel`, a
`LlamaForCausalLM` or a `Qwen2ForCausalLM` (a Llama with biases on q, k and v: `qkv_bias`).

- `hf_shape(dir)`: the GPTConfig fields of its `config.json` (what `--init-from` sets before
  `--model-config` and the single-field flags); `HfImportError` for a model this runtime does
  not train (another model type, rope scaling, biases on a Llama, another activation, Qwen2's
  sliding window).
- `HfCheckpoint(dir)` reads only the safetensors headers when it opens: `check(cfg)` refuses a
  missing or unexpected tensor, a wrong shape or a non-floating dtype, one line each.
- `HfCheckpoint.shard(name, cfg, rank, size)`: this runtime's parameter `name` (canonical
  name), as tensor-parallel rank `rank` of `size` holds it, read through safetensors' memory map
  slice by slice: a worker reads the rows or columns of its own shards and nothing else.

The layouts are elastic/ops/export.py's (GPT-2: Conv1D transposed, qkv columns (3, n_head,
head_dim) to head-major rows) and elastic/ops/hf_llama.py's (q/k/v by key/value group, gate/up
interleaved). A tied checkpoint (no `lm_head.weight`: GPT-2's, Llama 3.2's) sets `tie_embeddings`
(its config.json's `tie_word_embeddings`), and the head's copy starts as the embedding
(elastic/parallel/tied.py keeps them one); a model config that sets it false unties them, and
the two train apart from there. A checkpoint with its own head cannot be tied. GPT-2's learned positions are
cut to the run's `seq_len` (at most its `n_positions`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from elastic.model.config import GPTConfig, read_config_file

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
IGNORED = ("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")
"""Buffers some checkpoints carry that are not parameters."""


class HfImportError(ValueError):
    """The directory is not a checkpoint of this model (one line for the user)."""


def _config(path: Path) -> dict[str, Any]:
    try:
        return read_config_file(Path(path) / CONFIG)
    except ValueError as exc:
        raise HfImportError(f"--init-from {path}: {exc}") from None


def _rope(c: dict[str, Any], where: str) -> dict[str, object]:
    """The rotary fields: theta, and Llama 3.1's `llama3` scaling (transformers 4's `rope_scaling`
    beside `rope_theta`, or 5's `rope_parameters`); HfImportError for another scaling."""
    params = c.get("rope_parameters") or {}
    scaling = c.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    out: dict[str, object] = {"rope_theta": float(params.get("rope_theta", c.get("rope_theta", 10000.0)))}
    if kind == "llama3":
        out.update(rope_factor=float(scaling["factor"]), rope_low_freq_factor=float(scaling["low_freq_factor"]),
                   rope_high_freq_factor=float(scaling["high_freq_factor"]),
                   rope_original_context=int(scaling["original_max_position_embeddings"]))
    elif kind != "default":
        raise HfImportError(f"{where}: rope scaling {kind!r} is not supported (none, or Llama 3.1's llama3)")
    return out


def hf_shape(path: Path) -> dict[str, object]:
    """The GPTConfig fields of the checkpoint at `path` (its config.json); HfImportError if this
    runtime does not train that model, or a field is missing or not a number."""
    c, where = _config(path), f"--init-from {path}"
    try:
        return _shape(c, where)
    except HfImportError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise HfImportError(f"{where}: {CONFIG} lacks or mistypes a field ({type(exc).__name__}: {exc})") from None


def _shape(c: dict[str, Any], where: str) -> dict[str, object]:
    kind = c.get("model_type")
    if kind in ("llama", "qwen2"):
        if c.get("attention_bias") or c.get("mlp_bias") or c.get("hidden_act", "silu") != "silu":
            raise HfImportError(f"{where}: a Llama with biases or activation {c.get('hidden_act')!r} is not supported")
        if c.get("use_sliding_window"):
            raise HfImportError(f"{where}: sliding-window attention (use_sliding_window) is not supported")
        heads, width = int(c["num_attention_heads"]), int(c["hidden_size"])
        if int(c.get("head_dim") or width // heads) * heads != width:
            raise HfImportError(f"{where}: head_dim {c.get('head_dim')} x {heads} heads != hidden_size {width}")
        return {"arch": "llama", "vocab_size": int(c["vocab_size"]), "n_layer": int(c["num_hidden_layers"]),
                "n_head": heads, "n_kv_heads": int(c.get("num_key_value_heads") or heads), "d_model": width,
                "ffn_hidden": int(c["intermediate_size"]), "norm_eps": float(c.get("rms_norm_eps", 1e-6)),
                "tie_embeddings": bool(c.get("tie_word_embeddings", False)), "qkv_bias": kind == "qwen2",
                **_rope(c, where)}
    if kind == "gpt2":
        if c.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
            raise HfImportError(f"{where}: activation {c.get('activation_function')!r} is not GPT-2's tanh GELU")
        width = int(c["n_embd"])
        if c.get("n_inner") not in (None, 4 * width) or float(c.get("layer_norm_epsilon", 1e-5)) != 1e-5:
            raise HfImportError(f"{where}: a GPT-2 with n_inner {c.get('n_inner')} or layer_norm_epsilon "
                                f"{c.get('layer_norm_epsilon')} is not supported (4 x n_embd, 1e-5)")
        return {"arch": "gpt2", "vocab_size": int(c["vocab_size"]), "n_layer": int(c["n_layer"]),
                "n_head": int(c["n_head"]), "d_model": width, "tie_embeddings": bool(c.get("tie_word_embeddings", True))}
    raise HfImportError(f"{where}: model_type {kind!r} is not supported (gpt2, llama or qwen2)")


def hf_positions(path: Path) -> int | None:
    """GPT-2's n_positions (the longest seq_len its learned positions cover); None for Llama."""
    c = _config(path)
    return int(c["n_positions"]) if c.get("model_type") == "gpt2" else None


class HfTensors:
    """Transformers' tensors by name, each read whole or by a range of rows or columns: the
    mapping onto this runtime's parameters (`shard`, `check`). This base holds them in memory (a
    model's `state_dict()`); `HfCheckpoint` reads them from files."""

    def __init__(self, tensors: dict[str, torch.Tensor] | None = None, *, where: str = "the checkpoint") -> None:
        self.tensors = tensors or {}
        self.where = where
        self.headers: dict[str, tuple[tuple[int, ...], str]] = {
            n: (tuple(t.shape), {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                                 torch.float64: "F64"}.get(t.dtype, str(t.dtype))) for n, t in self.tensors.items()}

    def _read(self, name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> torch.Tensor:
        t = self.tensors[name]
        t = t if rows is None else t[rows[0]:rows[1]]
        return t if cols is None else t[:, cols[0]:cols[1]]

    def tied(self) -> bool:
        """No output head of its own: the head starts as the embedding (module doc)."""
        return "lm_head.weight" not in self.headers

    def check(self, cfg: GPTConfig) -> None:
        """HfImportError unless the tensors are exactly model `cfg`'s (names, shapes, floating dtypes)."""
        expected = _expected(cfg, tied=self.tied())
        where = self.where
        if cfg.tie_embeddings and not self.tied():
            raise HfImportError(f"{where}: the model ties its embedding and head (tie_embeddings) but the checkpoint "
                                "has an lm_head.weight of its own")
        for name, shape in expected.items():
            if name not in self.headers:
                raise HfImportError(f"{where}: the checkpoint has no tensor {name!r}")
            got, dtype = self.headers[name]
            # GPT-2's positions: at least seq_len rows (the run reads the first seq_len); the rest exactly
            wrong = got[0] < shape[0] or got[1:] != shape[1:] if name.endswith("wpe.weight") else got != shape
            if wrong:
                raise HfImportError(f"{where}: {name} has shape {list(got)}, model {cfg.arch} needs {list(shape)}")
            if dtype not in ("F32", "F16", "BF16", "F64"):
                raise HfImportError(f"{where}: {name} has dtype {dtype}, not a floating-point type")
        extra = sorted(n for n in self.headers if n not in expected and not n.endswith(IGNORED))
        if extra:
            raise HfImportError(f"{where}: unexpected tensor(s) {extra[:3]} for model {cfg.arch} "
                                f"({len(extra)} in all)")

    def shard(self, name: str, cfg: GPTConfig, rank: int, size: int) -> torch.Tensor:
        """This runtime's parameter `name` as tensor-parallel rank `rank` of `size` holds it (in the checkpoint's dtype)."""
        part: Callable[[int], tuple[int, int]] = lambda n: (rank * n // size, (rank + 1) * n // size)  # noqa: E731
        read = _llama_shard if cfg.arch == "llama" else _gpt2_shard
        return read(self, name, cfg, part).contiguous()


class HfCheckpoint(HfTensors):
    """The safetensors files of a checkpoint directory, opened lazily (module doc)."""

    def __init__(self, path: str | Path) -> None:
        from safetensors import safe_open

        self.path = Path(path)
        self.where = f"--init-from {self.path}"
        self.tensors = {}
        index = self.path / INDEX
        if index.is_file():
            try:
                files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise HfImportError(f"--init-from {self.path}: {INDEX} cannot be read: {exc}") from None
        elif (self.path / SINGLE).is_file():
            files = [SINGLE]
        else:
            raise HfImportError(f"--init-from {self.path}: no {SINGLE} or {INDEX}")
        self._handles: dict[str, Any] = {}
        self.headers = {}
        for name in files:
            try:
                handle = safe_open(str(self.path / name), framework="pt")
                for key in handle.keys():  # noqa: SIM118 - a safetensors handle is not iterable
                    piece = handle.get_slice(key)
                    self.headers[key] = (tuple(piece.get_shape()), str(piece.get_dtype()))
                    self._handles[key] = handle
            except Exception as exc:  # safetensors raises its own errors for a truncated or foreign file
                raise HfImportError(f"--init-from {self.path}: {name} is not a readable safetensors file "
                                    f"(truncated?): {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None

    def _read(self, name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> torch.Tensor:
        piece = self._handles[name].get_slice(name)  # a memory-mapped view: only the slice is read
        if len(self.headers[name][0]) == 1:
            return piece[slice(*rows)] if rows is not None else piece[:]
        r = slice(*rows) if rows is not None else slice(None)
        c = slice(*cols) if cols is not None else slice(None)
        return piece[r, c]


def _head_name(ckpt: HfTensors, embedding: str) -> str:
    return embedding if ckpt.tied() else "lm_head.weight"


def _llama_shard(ckpt: HfTensors, name: str, cfg: GPTConfig, part: Callable[[int], tuple[int, int]]) -> torch.Tensor:
    d, hd = cfg.d_model, cfg.head_dim
    if name == "embed.wte.weight":
        return ckpt._read("model.embed_tokens.weight", rows=part(cfg.vocab_size))
    if name == "head.lm_head.weight":
        return ckpt._read(_head_name(ckpt, "model.embed_tokens.weight"), rows=part(cfg.vocab_size))
    if name == "head.ln_f.weight":
        return ckpt._read("model.norm.weight")
    k, leaf = name.split(".", 2)[1], name.split(".", 2)[2]
    hf = f"model.layers.{k}."
    if leaf in ("ln1.weight", "ln2.weight"):
        return ckpt._read(hf + ("input_layernorm.weight" if leaf == "ln1.weight" else "post_attention_layernorm.weight"))
    if leaf == "attn.proj.weight":
        return ckpt._read(hf + "self_attn.o_proj.weight", cols=part(d))
    if leaf == "mlp.proj.weight":
        return ckpt._read(hf + "mlp.down_proj.weight", cols=part(cfg.d_ff))
    if leaf == "mlp.fc.weight":
        units = part(cfg.d_ff)
        gate, up = ckpt._read(hf + "mlp.gate_proj.weight", rows=units), ckpt._read(hf + "mlp.up_proj.weight", rows=units)
        return torch.stack((gate, up), dim=1).reshape(2 * (units[1] - units[0]), d)
    if leaf in ("attn.qkv.weight", "attn.qkv.bias"):
        # my query heads, and the key/value heads they use (whole, or shared: kv_layout); a bias's rows alike
        h0, h1 = part(cfg.n_head)
        per = cfg.n_head // cfg.kv_heads
        g0, g1 = h0 // per, -(-h1 // per)
        groups, kind, rest = g1 - g0, leaf.rsplit(".", 1)[1], (d,) if leaf.endswith("weight") else ()
        q = ckpt._read(hf + f"self_attn.q_proj.{kind}", rows=(h0 * hd, h1 * hd))
        kk = ckpt._read(hf + f"self_attn.k_proj.{kind}", rows=(g0 * hd, g1 * hd)).reshape(groups, 1, hd, *rest)
        v = ckpt._read(hf + f"self_attn.v_proj.{kind}", rows=(g0 * hd, g1 * hd)).reshape(groups, 1, hd, *rest)
        return torch.cat((q.reshape(groups, (h1 - h0) // groups, hd, *rest), kk, v), dim=1).reshape(-1, *rest)
    raise HfImportError(f"no Llama tensor maps to parameter {name!r}")


def _gpt2_shard(ckpt: HfTensors, name: str, cfg: GPTConfig, part: Callable[[int], tuple[int, int]]) -> torch.Tensor:
    d, hd = cfg.d_model, cfg.head_dim
    if name == "embed.wte.weight":
        return ckpt._read("transformer.wte.weight", rows=part(cfg.vocab_size))
    if name == "embed.wpe":
        return ckpt._read("transformer.wpe.weight", rows=(0, cfg.seq_len))
    if name == "head.lm_head.weight":
        return ckpt._read(_head_name(ckpt, "transformer.wte.weight"), rows=part(cfg.vocab_size))
    if name.startswith("head.ln_f."):
        return ckpt._read("transformer.ln_f." + name.rsplit(".", 1)[1])
    k, leaf = name.split(".", 2)[1], name.split(".", 2)[2]
    hf = f"transformer.h.{k}."
    simple = {"ln1.weight": "ln_1.weight", "ln1.bias": "ln_1.bias", "ln2.weight": "ln_2.weight", "ln2.bias": "ln_2.bias",
              "attn.proj.bias": "attn.c_proj.bias", "mlp.proj.bias": "mlp.c_proj.bias"}
    if leaf in simple:
        return ckpt._read(hf + simple[leaf])
    if leaf in ("attn.proj.weight", "mlp.proj.weight"):  # Conv1D (in, out): our columns are its rows
        width = d if leaf.startswith("attn") else cfg.d_ff
        return ckpt._read(hf + leaf.replace("proj", "c_proj"), rows=part(width)).t()
    if leaf == "mlp.fc.weight":
        return ckpt._read(hf + "mlp.c_fc.weight", cols=part(cfg.d_ff)).t()
    if leaf == "mlp.fc.bias":
        return ckpt._read(hf + "mlp.c_fc.bias", rows=part(cfg.d_ff))
    if leaf in ("attn.qkv.weight", "attn.qkv.bias"):  # columns (3, n_head, head_dim) -> rows head-major
        h0, h1 = part(cfg.n_head)
        cut = [(j * d + h0 * hd, j * d + h1 * hd) for j in range(3)]
        if leaf.endswith("bias"):
            parts = [ckpt._read(hf + "attn.c_attn.bias", rows=c).reshape(h1 - h0, 1, hd) for c in cut]
            return torch.cat(parts, dim=1).reshape(-1)
        parts = [ckpt._read(hf + "attn.c_attn.weight", cols=c).t().reshape(h1 - h0, 1, hd, d) for c in cut]
        return torch.cat(parts, dim=1).reshape(-1, d)
    raise HfImportError(f"no GPT-2 tensor maps to parameter {name!r}")


def _expected(cfg: GPTConfig, *, tied: bool) -> dict[str, tuple[int, ...]]:
    """Transformers' tensor names and full shapes of model `cfg` (GPT-2's positions: at least seq_len rows)."""
    d, f, v = cfg.d_model, cfg.d_ff, cfg.vocab_size
    if cfg.arch == "llama":
        kv = cfg.kv_heads * cfg.head_dim
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
        for k in range(cfg.n_layer):
            p = f"model.layers.{k}."
            out.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                        p + "self_attn.q_proj.weight": (d, d), p + "self_attn.k_proj.weight": (kv, d),
                        p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, d),
                        p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                        p + "mlp.down_proj.weight": (d, f)})
            if cfg.qkv_bias:
                out.update({p + "self_attn.q_proj.bias": (d,), p + "self_attn.k_proj.bias": (kv,),
                            p + "self_attn.v_proj.bias": (kv,)})
    else:
        out = {"transformer.wte.weight": (v, d), "transformer.wpe.weight": (cfg.seq_len, d),
               "transformer.ln_f.weight": (d,), "transformer.ln_f.bias": (d,)}
        for k in range(cfg.n_layer):
            p = f"transformer.h.{k}."
            out.update({p + "ln_1.weight": (d,), p + "ln_1.bias": (d,), p + "ln_2.weight": (d,), p + "ln_2.bias": (d,),
                        p + "attn.c_attn.weight": (d, 3 * d), p + "attn.c_attn.bias": (3 * d,),
                        p + "attn.c_proj.weight": (d, d), p + "attn.c_proj.bias": (d,),
                        p + "mlp.c_fc.weight": (d, f), p + "mlp.c_fc.bias": (f,),
                        p + "mlp.c_proj.weight": (f, d), p + "mlp.c_proj.bias": (d,)})
    if not tied:
        out["lm_head.weight"] = (v, d)
    return out


def load_hf_shards(module: torch.nn.Module, path: str | Path, *, tp_rank: int, tp_size: int) -> None:
    """Fill every parameter of `module` (a stage built uninitialised) with its shard of the
    checkpoint at `path`, read slice by slice (module doc)."""
    ckpt = HfCheckpoint(path)
    cfg: GPTConfig = module.cfg  # type: ignore[assignment]
    with torch.no_grad():
        for name, param in module.named_parameters():
            value = ckpt.shard(name, cfg, tp_rank, tp_size)
            if value.shape != param.shape:
                raise HfImportError(f"--init-from {path}: {name} reads as {list(value.shape)}, the stage holds "
                                    f"{list(param.shape)}")
            param.copy_(value)


def canonical_state(tensors: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """This runtime's full parameters (canonical names) of model `cfg` from transformers' tensors
    (a `state_dict()`); HfImportError as `HfTensors.check`."""
    kept = {n: t for n, t in tensors.items() if not n.endswith(IGNORED)}
    if cfg.tie_embeddings and "lm_head.weight" in kept:  # a tied model's state_dict lists the matrix twice
        embedding = kept["model.embed_tokens.weight" if cfg.arch == "llama" else "transformer.wte.weight"]
        if torch.equal(kept["lm_head.weight"], embedding):
            del kept["lm_head.weight"]
    source = HfTensors(kept)
    source.check(cfg)
    with torch.device("meta"):
        from elastic.model.gpt import GPTStage

        names = [n for n, _ in GPTStage(cfg, initialise=False).named_parameters()]
    return {n: source.shard(n, cfg, 0, 1) for n in names}
