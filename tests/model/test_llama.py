"""The Llama-family decoder (`arch = "llama"`, model/llama.py) against its references.

- transformers' `LlamaForCausalLM` (random weights, grouped-query attention with n_kv_heads <
  n_head, untied head), its tensors mapped by elastic/model/hf_import.py: the same logits and loss,
  to 1e-5 in fp32 and 1e-10 in fp64, for the whole model and two stages, at tensor-parallel
  degree 1 and 2 (ranks as threads over real gloo communicators). transformers' RMSNorm computes
  in fp32 whatever its input: the fp64 case lifts that cast (and runs its SDPA attention, whose
  eager form takes the softmax in fp32 too), so that 1e-10 compares the same function.
- The whole unsharded model: at tensor-parallel degree 2 and 4, with and without sequence
  parallelism and dropout, the loss and every gathered gradient equal it to 1e-5, also where
  ranks share key/value heads (fewer of them than ranks; each replica's gathered gradient is
  compared, so a replica that missed its peers' part fails); each recomputation mode gives the
  same loss and gradients bit for bit.
- Both directions of the mapping are each other's inverse, and export's config is one that
  transformers reads back into the same shape.
- Qwen2 (`qkv_bias`: biases on q, k and v, tied, rope base 1e6) against transformers'
  `Qwen2ForCausalLM` the same ways, its biases split with their weight's rows (shared with a
  shared key/value head, their gradient summed over its replicas).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from elastic.model import TensorParallel
from elastic.model.config import RECOMPUTE_MODES, GPTConfig
from elastic.model.gpt import GPTStage
from elastic.model.hf_import import HfImportError, canonical_state
from elastic.model.init import shard_tensor
from elastic.model.state import gather_full
from elastic.ops.hf_llama import hf_llama_config, to_hf_llama
from tests.comm.support import gloo_comms, on_threads
from tests.model.reference import max_rel_diff

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(180)

CFG = GPTConfig(arch="llama", vocab_size=256, seq_len=32, n_layer=3, n_head=8, n_kv_heads=4, d_model=64,
                ffn_hidden=160, rope_theta=5000.0, norm_eps=1e-6)
SCALED = dataclasses.replace(CFG, rope_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                             rope_original_context=64)
"""Llama 3.1's rope scaling, its wavelength bands (16 and 64 positions) inside head_dim 8's
wavelengths (6 to 3,300): some frequencies kept, some divided, some interpolated."""
TIED = dataclasses.replace(CFG, tie_embeddings=True)
"""One matrix for the embedding and the head, as Llama 3.2 1B and 3B."""
QWEN2 = dataclasses.replace(CFG, qkv_bias=True, rope_theta=1e6, tie_embeddings=True)
"""Qwen2's attention (biases on q, k and v), tied as Qwen2.5 0.5B and 1.5B: transformers'
`Qwen2ForCausalLM`."""
BATCH = 2


def _tokens(cfg: GPTConfig) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return (torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len), generator=g),
            torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len), generator=g))


def _hf_model(cfg: GPTConfig, dtype: torch.dtype) -> torch.nn.Module:
    """transformers' model of `cfg`, the class export's config names: a LlamaForCausalLM, or
    Qwen2ForCausalLM where `qkv_bias`."""
    config = transformers.AutoConfig.for_model(**hf_llama_config(cfg))
    config._attn_implementation = "sdpa"  # "eager" takes its softmax in fp32 whatever the dtype
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()
    assert model.config._attn_implementation == "sdpa"
    with torch.no_grad():  # norms off their initial 1, biases off 0: one applied wrongly shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture
def exact_hf_rmsnorm(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """transformers' RMSNorm in its input's dtype (it casts to fp32 otherwise: module doc)."""
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen2 import modeling_qwen2

    def forward(self: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        variance = hidden.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon))

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", forward)
    monkeypatch.setattr(modeling_qwen2.Qwen2RMSNorm, "forward", forward)
    yield


def _ours(cfg: GPTConfig, state: dict[str, torch.Tensor], tp: TensorParallel, cut: int | None,
          dtype: torch.dtype, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(full logits, loss) of the model with `state`, as one stage or two (`cut`), on `tp`."""
    bounds = [(0, cfg.num_layers)] if cut is None else [(0, cut), (cut, cfg.num_layers)]
    stages = [GPTStage(cfg, first=a, last=b, tp=tp, initialise=False).to(dtype).eval() for a, b in bounds]
    with torch.no_grad():
        for stage in stages:
            for name, p in stage.named_parameters():
                p.copy_(shard_tensor(state[name], p.tp_dim, tp.rank, tp.size, layout=p.tp_layout))  # type: ignore[attr-defined]
    x: torch.Tensor = tokens
    with torch.no_grad():
        for stage in stages:
            x = stage(x, dropout_key=0)
        loss = stages[-1].loss(x, targets)
    return gather_full(x, 2, tp), loss


@pytest.mark.parametrize("cfg", [CFG, SCALED, TIED, QWEN2], ids=["plain-rope", "llama3-rope", "tied", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_same_function_as_transformers(dtype: torch.dtype, cfg: GPTConfig, exact_hf_rmsnorm: None,
                                           request: pytest.FixtureRequest) -> None:
    if dtype == torch.float32:
        request.getfixturevalue("monkeypatch").undo()  # fp32: transformers exactly as it ships
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    hf = _hf_model(cfg, dtype)
    if cfg.rope_factor:  # the scaling reached transformers (its config holds it in either form)
        assert "llama3" in json.dumps(hf.config.to_dict())
    tokens, targets = _tokens(cfg)
    with torch.no_grad():
        want = hf(tokens).logits
    want_loss = F.cross_entropy(want.reshape(-1, cfg.vocab_size), targets.reshape(-1))
    state = canonical_state(hf.state_dict(), cfg)
    for degree in (1, 2):
        comms = gloo_comms(degree, name=f"llama-hf-{degree}-{dtype}")
        for cut in (None, 2):
            def one(r: int, comms: list = comms, degree: int = degree, cut: int | None = cut) -> object:  # type: ignore[type-arg]
                return _ours(cfg, state, TensorParallel(group=comms[r], rank=r, size=degree), cut, dtype, tokens, targets)

            got = on_threads(degree, one)
            for rank, result in enumerate(got):
                assert not isinstance(result, BaseException), result
                logits, loss = result
                assert logits.dtype == dtype
                what = f"TP {degree}, cut {cut}, rank {rank}, {dtype}"
                assert max_rel_diff(logits, want) <= tol, (what, max_rel_diff(logits, want))
                assert max_rel_diff(loss, want_loss) <= tol, (what, loss.item(), want_loss.item())
        for c in comms:
            c.shutdown()


@pytest.mark.parametrize("cfg", [CFG, dataclasses.replace(QWEN2, tie_embeddings=False)], ids=["llama", "qwen2"])
def test_the_mapping_both_ways_and_the_config(cfg: GPTConfig) -> None:
    hf = _hf_model(cfg, torch.float32)
    theirs = {n: t for n, t in hf.state_dict().items() if "rotary" not in n}
    back = to_hf_llama(canonical_state(theirs, cfg), cfg)
    assert back.keys() == theirs.keys()
    assert all(torch.equal(back[n], theirs[n]) for n in theirs)
    config = transformers.AutoConfig.for_model(**hf_llama_config(cfg))
    assert type(config).__name__ == ("Qwen2Config" if cfg.qkv_bias else "LlamaConfig")
    assert (config.num_key_value_heads, config.intermediate_size, config.head_dim) == (cfg.kv_heads, cfg.d_ff, cfg.head_dim)
    for gone in ("model.layers.1.self_attn.k_proj.weight", "model.layers.1.self_attn.k_proj.bias"):
        if gone in theirs:
            missing = {n: t for n, t in theirs.items() if n != gone}
            with pytest.raises(HfImportError, match=gone):
                canonical_state(missing, cfg)


@pytest.mark.parametrize("cfg", [TIED, QWEN2], ids=["llama", "qwen2"])
def test_a_tied_model_maps_both_ways(tmp_path: Path, cfg: GPTConfig) -> None:
    """transformers' tied model (its head is its embedding) reads as both copies of one matrix;
    the export writes no head of its own, and transformers loads it back tied (as a Qwen2 where
    there are qkv biases), the same logits."""
    from elastic.model.hf_import import hf_shape
    from elastic.ops.export import write_hf

    hf = _hf_model(cfg, torch.float32)
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    state = canonical_state(hf.state_dict(), cfg)
    assert torch.equal(state["head.lm_head.weight"], state["embed.wte.weight"])
    write_hf(tmp_path, state, cfg, tokenizer=None, source="test")
    assert hf_shape(tmp_path)["tie_embeddings"] is True and hf_shape(tmp_path)["qkv_bias"] is cfg.qkv_bias
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert type(back) is type(hf)
    assert back.lm_head.weight is back.model.embed_tokens.weight
    tokens, _ = _tokens(cfg)
    with torch.no_grad():
        assert torch.equal(back(tokens).logits, hf(tokens).logits)


def _step(cfg: GPTConfig, tp: TensorParallel, *, sp: bool, mode: str) -> dict[str, torch.Tensor]:
    """One training forward and backward of the whole model as two stages: loss and every
    gathered (full) gradient."""
    tokens, targets = _tokens(cfg)
    stages = [GPTStage(cfg, first=a, last=b, tp=tp, recompute=mode, sequence_parallel=sp).train()
              for a, b in ((0, 2), (2, cfg.num_layers))]
    x: torch.Tensor = tokens
    for stage in stages:
        x = stage(x, dropout_key=5)
    loss = stages[-1].loss(x, targets)
    loss.backward()
    out = {"loss": loss.detach()}
    for stage in stages:
        for name, p in stage.named_parameters():
            assert p.grad is not None, name
            out[name] = gather_full(p.grad, p.tp_dim, tp, layout=p.tp_layout)  # type: ignore[attr-defined]
            shared = p.tp_layout  # type: ignore[attr-defined]
            if shared is not None and tp.size > 1:  # every replica of a key/value head holds its whole gradient
                held = gather_full(p.grad, 0, tp)
                assert torch.equal(held, shared.expand(out[name], tp.size)), name
    return out


def _run(cfg: GPTConfig, degree: int, *, sp: bool = False, mode: str = "none") -> list[dict[str, torch.Tensor]]:
    comms = gloo_comms(degree, name=f"llama-{degree}-{sp}-{mode}-{cfg.dropout}")
    results = on_threads(degree, lambda r: _step(cfg, TensorParallel(group=comms[r], rank=r, size=degree), sp=sp,
                                                 mode=mode))
    for c in comms:
        c.shutdown()
    assert not any(isinstance(r, BaseException) for r in results), results
    return results


@pytest.mark.parametrize(("kv_heads", "qkv_bias"), [(4, False), (2, False), (1, False), (4, True), (1, True)],
                         ids=["kv4", "kv2-shared-at-4", "kv1-shared", "kv4-qkv-bias", "kv1-shared-qkv-bias"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_tensor_and_sequence_parallel_equal_the_whole_model(dropout: float, kv_heads: int, qkv_bias: bool) -> None:
    """With fewer key/value heads than ranks (kv2 at TP 4, kv1 at TP 2 and 4) they are shared;
    Qwen2's qkv biases are split with the rows of their weight, shared rows' gradients summed alike."""
    cfg = dataclasses.replace(CFG, dropout=dropout, n_kv_heads=kv_heads, qkv_bias=qkv_bias)
    (whole,) = _run(cfg, 1)
    for degree in (2, 4):
        for sp in (False, True):
            for rank, got in enumerate(_run(cfg, degree, sp=sp)):
                assert got.keys() == whole.keys()
                for name, want in whole.items():
                    rel = max_rel_diff(got[name], want)
                    assert rel <= 1e-5, (f"TP {degree} sp {sp} rank {rank} dropout {dropout}: {name}", rel)


@pytest.mark.parametrize(("degree", "kv_heads"), [(1, 4), (2, 4), (2, 1)])
def test_recomputation_is_bit_for_bit(degree: int, kv_heads: int) -> None:
    cfg = dataclasses.replace(CFG, dropout=0.1, n_kv_heads=kv_heads)
    plain = _run(cfg, degree, sp=degree > 1)
    for mode in RECOMPUTE_MODES:
        for want, got in zip(plain, _run(cfg, degree, sp=degree > 1, mode=mode), strict=True):
            assert all(torch.equal(got[n], want[n]) for n in want), mode
