"""`elastic run --init-from DIR` (issue 58 item 4): Hugging Face checkpoints made here with
transformers (`from_config`, `save_pretrained`), a sharded LlamaForCausalLM with grouped-query
attention and an untied head, and a tied GPT2LMHeadModel whose positions outnumber the run's.

- Read slice by slice (elastic/model/hf_import.py), every stage of every layout is the checkpoint's
  model: the logits of transformers' model to 1e-5 (fp32), at tensor-parallel degree 1 and 2
  (ranks as threads over real gloo communicators), as one stage and as two; Llama also at 8,
  where two ranks share each of its four key/value heads.
- A real elastic run (4 nodes x 2 workers, f = 1) from the Llama checkpoint on data prepared here
  (`prepare-data`, a BPE tokenizer): its first step's loss is transformers' loss on that step's
  samples, node 3 SIGKILLed at step 9 ends bit for bit as the failure-free run, the summary says
  where the weights came from, and the export loads in transformers, whose greedy continuation
  is `elastic sample`'s.
- Bad checkpoints: a missing tensor, a wrong shape, a vocabulary smaller than the data's
  tokenizer's and a truncated safetensors file are each one line and exit code 2, before any
  process starts.
- Qwen2 (a Llama with biases on q, k and v, `qkv_bias`): every layout reads it (TP 1, 2, 8), a
  run from it starts at transformers' loss and exports a Qwen2ForCausalLM that continues as
  `elastic sample` does; its sliding window is refused.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from elastic.data.dataset import TokenDataset, step_sample_indices
from elastic.model import TensorParallel
from elastic.model.config import GPTConfig, get_preset
from elastic.model.gpt import GPTStage
from elastic.model.hf_import import hf_shape, load_hf_shards
from elastic.model.state import gather_full
from elastic.ops.hf_llama import hf_llama_config
from tests.comm.support import gloo_comms, on_threads
from tests.faults.cli_runs import cli_in_process, run_cli, same_bits
from tests.model.reference import max_rel_diff

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(300)

LLAMA = get_preset("llama-tiny")
GPT2 = GPTConfig(vocab_size=256, seq_len=64, n_layer=2, n_head=4, d_model=64)


def _perturb(model: torch.nn.Module) -> None:
    with torch.no_grad():  # norms and biases off their initial values, so that a misplaced one shows
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))


def _save_llama(path: Path, cfg: GPTConfig, *, seed: int, **save: str) -> Path:
    """A random LlamaForCausalLM of shape `cfg` (Qwen2ForCausalLM where `qkv_bias`), its norms
    and biases perturbed, saved into `path`."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hf_llama_config(cfg)))
    _perturb(model)
    model.save_pretrained(str(path), **save)
    return path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = _save_llama(tmp_path_factory.mktemp("hf-llama"), LLAMA, seed=0, max_shard_size="300KB")
    assert (path / "model.safetensors.index.json").is_file()  # several files and an index
    return path


QWEN2 = LLAMA.with_overrides(qkv_bias=True, rope_theta=1e6)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_llama(tmp_path_factory.mktemp("hf-qwen2"), QWEN2, seed=2)


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hf-gpt2")
    torch.manual_seed(1)
    config = transformers.GPT2Config(vocab_size=GPT2.vocab_size, n_positions=128, n_embd=GPT2.d_model,
                                     n_layer=GPT2.n_layer, n_head=GPT2.n_head, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)  # tied: no lm_head.weight in the file
    _perturb(model)
    model.save_pretrained(str(path))
    return path


def _theirs(path: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path)).eval()
    with torch.no_grad():
        return model(tokens).logits


def _ours(cfg: GPTConfig, path: Path, tp: TensorParallel, cut: int | None, tokens: torch.Tensor) -> torch.Tensor:
    bounds = [(0, cfg.num_layers)] if cut is None else [(0, cut), (cut, cfg.num_layers)]
    x = tokens
    for first, last in bounds:
        stage = GPTStage(cfg, first=first, last=last, tp=tp, initialise=False).eval()
        load_hf_shards(stage, path, tp_rank=tp.rank, tp_size=tp.size)
        with torch.no_grad():
            x = stage(x, dropout_key=0)
    return gather_full(x, 2, tp)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
def test_every_layout_reads_the_checkpoints_model(arch: str, llama_dir: Path, gpt2_dir: Path, qwen2_dir: Path) -> None:
    cfg, path = {"llama": (LLAMA, llama_dir), "gpt2": (GPT2, gpt2_dir), "qwen2": (QWEN2, qwen2_dir)}[arch]
    assert {k: v for k, v in hf_shape(path).items() if k in ("arch", "qkv_bias")} == {
        "arch": cfg.arch, **({"qkv_bias": cfg.qkv_bias} if cfg.arch == "llama" else {})}
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(4))
    want = _theirs(path, tokens)
    for degree in (1, 2, 8) if arch != "gpt2" else (1, 2):  # 8: two ranks share each key/value head
        comms = gloo_comms(degree, name=f"init-from-{arch}-{degree}")
        for cut in (None, 2):
            def one(r: int, comms: list = comms, degree: int = degree, cut: int | None = cut) -> object:  # type: ignore[type-arg]
                return _ours(cfg, path, TensorParallel(group=comms[r], rank=r, size=degree), cut, tokens)

            for rank, got in enumerate(on_threads(degree, one)):
                assert isinstance(got, torch.Tensor), got
                assert max_rel_diff(got, want) <= 1e-5, (arch, degree, cut, rank, max_rel_diff(got, want))
        for c in comms:
            c.shutdown()


RUN = [sys.executable, "-m", "elastic.cli", "run", "--model", "llama-tiny", "--nodes", "4", "--gpus-per-node", "2",
       "--fault-tolerance", "1", "--global-batch", "8", "--microbatch", "1", "--steps", "10", "--device", "cpu",
       "--checkpoint-every", "0", "--lease-ttl", "30"]


WIDE = LLAMA.with_overrides(vocab_size=320)
"""llama-tiny with room for a tokenizer of 300 ids (a byte-level BPE needs 258 at least)."""


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_llama(tmp_path_factory.mktemp("hf-llama-wide"), WIDE, seed=2)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Training data of the user's own: a byte-level BPE tokenizer of 300 ids over text made here."""
    root = tmp_path_factory.mktemp("prepared")
    corpus = root / "corpus.txt"
    corpus.write_text("".join(f"def node_{i}(step):\n    return step * {i} + {i % 7}  # elastic pipelines fail and recover\n"
                              for i in range(400)))
    code, _, err = cli_in_process("prepare-data", str(corpus), "--out", str(root / "data"), "--vocab-size", "300")
    assert code == 0, err
    return root / "data"


@pytest.mark.slow
def test_a_run_from_the_checkpoint_through_a_failure(wide_dir: Path, prepared: Path, tmp_path: Path) -> None:
    """Issue 58's "training from it": `--init-from DIR --data DIR`, a kill at step 9 ending as the
    failure-free run, the export loaded in transformers, whose greedy continuation is `elastic sample`'s."""
    start = ["--init-from", str(wide_dir), "--data", str(prepared)]
    killed = run_cli([*RUN, *start, "--inject", "kill:node=3,step=9"], tmp_path / "killed", committed=10,
                     lost=[[3]], timeout=200)
    clean = run_cli([*RUN, *start], tmp_path / "clean", committed=10, lost=[], timeout=200)
    same_bits(killed, clean, "llama-tiny from a checkpoint, node 3 killed at step 9")
    assert killed[0]["init_from"] == str(wide_dir.resolve()) and killed[0]["model"]["vocab_size"] == WIDE.vocab_size
    inputs, targets = TokenDataset(seq_len=WIDE.seq_len, path=str(prepared)).batch(step_sample_indices(0, 8))
    logits = _theirs(wide_dir, inputs)
    want = F.cross_entropy(logits.reshape(-1, WIDE.vocab_size), targets.reshape(-1)).item()
    assert abs(killed[0]["losses"][0] - want) <= 1e-5 * want, (killed[0]["losses"][0], want)

    from tokenizers import Tokenizer

    code, _, err = cli_in_process("export", str(tmp_path / "killed"), "--format", "hf", str(tmp_path / "hf"))
    assert code == 0, err
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    tokenizer = Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json"))
    prompt, new = "def node_3(step):", 40
    ids = tokenizer.encode(prompt).ids
    with torch.no_grad():
        for _ in range(new):
            ids.append(int(hf(torch.tensor([ids[-LLAMA.seq_len:]])).logits[0, -1].argmax()))
    code, out, err = cli_in_process("sample", str(tmp_path / "killed"), "--prompt", prompt, "--max-new-tokens", str(new),
                                    "--top-k", "1")
    assert code == 0, err
    prompted = len(tokenizer.encode(prompt).ids)
    assert out == prompt + tokenizer.decode(ids[prompted:]) + "\n", (out, tokenizer.decode(ids))  # the prompt, then the new text


def _refused(tmp_path: Path, path: Path, *extra: str) -> str:
    code, _, err = cli_in_process("run", "--model", "llama-tiny", "--nodes", "2", "--steps", "1", "--device", "cpu",
                        "--run-dir", str(tmp_path / "run"), "--init-from", str(path), *extra)
    assert code == 2 and len(err.strip().splitlines()) == 1, (code, err)
    assert not (tmp_path / "run").exists(), "nothing is started on a refusal"
    return err


def _copy(src: Path, dst: Path) -> Path:
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_bad_checkpoints_are_one_line_and_exit_2(llama_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    missing = _copy(llama_dir, tmp_path / "missing")
    tensors = load_file(str(missing / "model.safetensors"))
    del tensors["model.layers.2.mlp.up_proj.weight"]
    save_file(tensors, str(missing / "model.safetensors"))
    assert "no tensor 'model.layers.2.mlp.up_proj.weight'" in _refused(tmp_path / "a", missing)

    shape = _copy(llama_dir, tmp_path / "shape")
    config = json.loads((shape / "config.json").read_text())
    config["intermediate_size"] = 256
    (shape / "config.json").write_text(json.dumps(config))
    assert "mlp.gate_proj.weight has shape [384, 128], model llama needs [256, 128]" in _refused(tmp_path / "b", shape)

    truncated = _copy(llama_dir, tmp_path / "truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert "not a readable safetensors file" in _refused(tmp_path / "c", truncated)

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the model trains on nodes and fails and trains again; " * 400)
    code, _, err = cli_in_process("prepare-data", str(corpus), "--out", str(tmp_path / "data"), "--vocab-size", "300")
    assert code == 0, err
    err = _refused(tmp_path / "d", llama_dir, "--data", str(tmp_path / "data"))
    assert "vocab_size=256 does not cover the tokenizer" in err, err

    untied = _copy(llama_dir, tmp_path / "untied")  # its own lm_head.weight, its config claiming a tie
    config = json.loads((untied / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (untied / "config.json").write_text(json.dumps(config))
    assert "has an lm_head.weight of its own" in _refused(tmp_path / "f", untied)

    other = _copy(llama_dir, tmp_path / "other")
    config = json.loads((other / "config.json").read_text())
    config["model_type"] = "bert"
    (other / "config.json").write_text(json.dumps(config))
    assert "model_type 'bert' is not supported" in _refused(tmp_path / "e", other)


def test_qwen2s_sliding_window_is_refused(qwen2_dir: Path, tmp_path: Path) -> None:
    sliding = _copy(qwen2_dir, tmp_path / "sliding")
    config = json.loads((sliding / "config.json").read_text())
    config["use_sliding_window"] = True
    (sliding / "config.json").write_text(json.dumps(config))
    assert "sliding-window attention (use_sliding_window) is not supported" in _refused(tmp_path / "a", sliding)


def test_rope_scaling_is_read_or_refused(tmp_path: Path) -> None:
    from elastic.model.hf_import import HfImportError, hf_shape
    from elastic.ops.hf_llama import hf_llama_config

    cfg = get_preset("llama3.2-1b")  # Llama 3.2's own scaling: factor 32, bands 1 and 4 of 8192 positions
    transformers.LlamaConfig(**hf_llama_config(cfg)).save_pretrained(str(tmp_path / "scaled"))
    shape = hf_shape(tmp_path / "scaled")
    assert {k: shape[k] for k in ("rope_theta", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                                  "rope_original_context")} == {
        "rope_theta": 500000.0, "rope_factor": 32.0, "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0,
        "rope_original_context": 8192}
    assert shape["tie_embeddings"] is True  # Llama 3.2's head is its embedding
    config = json.loads((tmp_path / "scaled" / "config.json").read_text())
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(config.get(key), dict):
            config[key] = {**config[key], "rope_type": "yarn"}
    (tmp_path / "scaled" / "config.json").write_text(json.dumps(config))
    with pytest.raises(HfImportError, match="rope scaling 'yarn' is not supported"):
        hf_shape(tmp_path / "scaled")


@pytest.mark.slow
def test_a_run_from_a_qwen2_checkpoint(prepared: Path, tmp_path: Path) -> None:
    """A Qwen2 checkpoint (biases on q, k and v, tied, one key/value head) through `elastic run` at
    TP 2 on two pipelines, the head and its biases shared by the two ranks: the first step's loss
    is transformers' on the same batch, the losses and gradient norms those of the same job at TP
    1 (the shared biases' gradient summed, counted once), and the export loads as a
    Qwen2ForCausalLM with the run's final weights (its greedy continuation `elastic sample`'s)."""
    shape = WIDE.with_overrides(qkv_bias=True, rope_theta=1e6, tie_embeddings=True, n_kv_heads=1)
    path = _save_llama(tmp_path / "qwen2", shape, seed=5)
    run = [*RUN[:7], "2", *RUN[8:], "--steps", "3", "--init-from", str(path), "--data", str(prepared)]  # 2 nodes
    summary, _, _ = run_cli(run, tmp_path / "run", committed=3, lost=[], timeout=200)
    assert {k: summary["model"][k] for k in ("qkv_bias", "tie_embeddings", "n_kv_heads")} == {
        "qkv_bias": True, "tie_embeddings": True, "n_kv_heads": 1}
    whole, _, _ = run_cli([*run, "--gpus-per-node", "1"], tmp_path / "tp1", committed=3, lost=[], timeout=200)
    for what in ("losses", "grad_norms"):
        for got, want in zip(summary[what], whole[what], strict=True):
            assert abs(got - want) <= 1e-5 * abs(want), (what, got, want)
    inputs, targets = TokenDataset(seq_len=shape.seq_len, path=str(prepared)).batch(step_sample_indices(0, 8))
    logits = _theirs(path, inputs)
    want = F.cross_entropy(logits.reshape(-1, shape.vocab_size), targets.reshape(-1)).item()
    assert abs(summary["losses"][0] - want) <= 1e-5 * want, (summary["losses"][0], want)
    code, _, err = cli_in_process("export", str(tmp_path / "run"), "--format", "hf", str(tmp_path / "hf"))
    assert code == 0, err
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert type(hf).__name__ == "Qwen2ForCausalLM"
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json"))
    prompt, new = "def node_5(step):", 12
    ids = tokenizer.encode(prompt).ids
    prompted = len(ids)
    with torch.no_grad():
        for _ in range(new):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    code, out, err = cli_in_process("sample", str(tmp_path / "run"), "--prompt", prompt, "--max-new-tokens", str(new),
                                    "--top-k", "1")
    assert code == 0, err
    assert out == prompt + tokenizer.decode(ids[prompted:]) + "\n", (out, tokenizer.decode(ids))
