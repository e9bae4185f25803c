"""`elastic export --format hf` and `elastic sample` on a real elastic run (etcd, agents, workers).

Export: transformers' GPT2LMHeadModel loaded from the export computes this project's logits
(fp32, 1e-5 of their scale) on several token sequences, for the final state and for a
checkpoint step, whose parameters equal a 5-step failure-free run's; the head stays untied.
Sample: greedy sampling (`--top-k 1`, and `--temperature 0`) prints exactly what a greedy
decode with the exported transformers model gives, through more tokens than the context window;
a tokenizer.json (`--tokenizer`) is used to encode and decode. Bad input: one line, nothing written.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from elastic.model.config import get_preset
from elastic.ops.sample import load_model
from tests.faults.cli_runs import cli_in_process
from tests.faults.runs import run_elastic, static_reference

pytestmark = pytest.mark.timeout(300)

TINY = get_preset("tiny")
SEQUENCES = [list(range(0, 64)), [ord(c) for c in "def elastic(nodes):\n    return nodes"], [255, 0, 17, 32, 101]]
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6 steps of tiny on 2 nodes (one 2-stage pipeline), a checkpoint at step 5."""
    path = tmp_path_factory.mktemp("export-run")
    run_elastic(path, nodes=2, pipelines=1, fault_tolerance=0, steps=6, checkpoint_every=5)
    return path


def _hf_logits(model_dir: Path, sequences: list[list[int]]) -> list[torch.Tensor]:
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(str(model_dir)).eval()
    with torch.no_grad():
        return [model(torch.tensor([seq])).logits[0] for seq in sequences]


def _our_logits(state: dict[str, torch.Tensor], sequences: list[list[int]]) -> list[torch.Tensor]:
    model = load_model(state, TINY)
    with torch.no_grad():
        return [model(torch.tensor([seq]), dropout_key=0)[0] for seq in sequences]


def _check_same_logits(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for seq, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == w.shape
        diff = float((g - w).abs().max() / w.abs().max())
        print(f"sequence {seq}: max |logit difference| / max |logit| = {diff:.2e}")
        assert diff <= TOLERANCE, f"sequence {seq}: logits differ by {diff:.2e}"


@pytest.mark.slow
def test_export_final_state_loads_in_transformers_with_the_same_logits(run_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from elastic.ops.run_state import final_state, read_spec

    code, out, err = cli_in_process("export", str(run_dir), "--format", "hf", str(tmp_path / "hf"))
    assert code == 0, err
    assert "config.json, model.safetensors" in out and "no tokenizer" in out
    state = final_state(read_spec(run_dir))
    _check_same_logits(_hf_logits(tmp_path / "hf", SEQUENCES), _our_logits(state, SEQUENCES))
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert torch.equal(tensors["lm_head.weight"], state["head.lm_head.weight"])  # untied, exported as is
    assert not torch.equal(tensors["lm_head.weight"], tensors["transformer.wte.weight"])


@pytest.mark.slow
def test_export_of_a_checkpoint_step_is_that_step(run_dir: Path, tmp_path: Path) -> None:
    code, out, err = cli_in_process("export", str(run_dir), "--format", "hf", str(tmp_path / "hf"), "--step", "5")
    assert code == 0, err
    assert "checkpoint of step 5" in out
    _, after_5 = static_reference(tmp_path / "reference", steps=5)
    _check_same_logits(_hf_logits(tmp_path / "hf", SEQUENCES), _our_logits(after_5, SEQUENCES))


@pytest.mark.slow
def test_export_refuses_bad_input_with_one_line(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    code, _, err = cli_in_process("export", str(tmp_path / "absent"), "--format", "hf", str(out))
    assert code == 2 and err.count("\n") == 1 and "does not exist" in err
    code, _, err = cli_in_process("export", str(tmp_path), "--format", "hf", str(out))
    assert code == 1 and err.count("\n") == 1 and "holds no job spec" in err, err
    code, _, err = cli_in_process("export", str(run_dir), "--format", "hf", str(out), "--step", "3")
    assert code == 1 and err.count("\n") == 1 and "no checkpoint of step 3" in err and "[5]" in err, err
    assert not out.exists(), "nothing is written on a refusal"


def _greedy_hf(model_dir: Path, prompt: list[int], new: int) -> list[int]:
    """Greedy decode with transformers' model over a sliding window of n_positions tokens."""
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(str(model_dir)).eval()
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(new):
            window = torch.tensor([tokens[-model.config.n_positions:]])
            tokens.append(int(model(window).logits[0, -1].argmax()))
    return tokens[len(prompt):]


@pytest.mark.slow
def test_greedy_sample_equals_a_reference_greedy_decode(run_dir: Path, tmp_path: Path) -> None:
    assert cli_in_process("export", str(run_dir), "--format", "hf", str(tmp_path / "hf"))[0] == 0
    prompt, new = "def main(", 90  # 9 + 90 tokens: past the 64-token window
    want = prompt + bytes(_greedy_hf(tmp_path / "hf", list(prompt.encode()), new)).decode("utf-8", "replace")
    for flags in (["--top-k", "1"], ["--temperature", "0"]):
        code, out, err = cli_in_process("sample", str(run_dir), "--prompt", prompt, "--max-new-tokens", str(new), *flags)
        assert code == 0, err
        assert out == want + "\n", (out, want)
    # Top-k sampling: the seed decides, and it is not the greedy text.
    drawn = [cli_in_process("sample", str(run_dir), "--prompt", prompt, "--max-new-tokens", "40", "--top-k", "20",
                  "--temperature", "1.5", "--seed", str(s))[1] for s in (1, 1, 2)]
    assert drawn[0] == drawn[1] != drawn[2]


@pytest.mark.slow
def test_sample_encodes_and_decodes_with_a_tokenizer(run_dir: Path, tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["[UNK]", "the", "model", "trains", "on", "nodes", "and", "fails"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    state = _our_state(run_dir)
    prompt = tok.encode("the model trains").ids
    model = load_model(state, TINY)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(model(torch.tensor([ids]), dropout_key=0)[0, -1].argmax()))
    code, out, err = cli_in_process("sample", str(run_dir), "--prompt", "the model trains", "--max-new-tokens", "12",
                          "--top-k", "1", "--tokenizer", str(path))
    assert code == 0, err
    assert out == "the model trains" + tok.decode(ids[len(prompt):]) + "\n"


def _our_state(run_dir: Path) -> dict[str, torch.Tensor]:
    from elastic.ops.run_state import final_state, read_spec

    return final_state(read_spec(run_dir))


def test_sample_refuses_bad_flags_with_one_line(tmp_path: Path) -> None:
    for flags, words in ((["--top-k", "0"], "--top-k"), (["--temperature", "-1"], "--temperature"),
                         (["--max-new-tokens", "-2"], "--max-new-tokens"), (["--tokenizer", "nope.json"], "nope")):
        code, _, err = cli_in_process("sample", str(tmp_path), "--prompt", "x", *flags)
        assert code == 2 and err.count("\n") == 1 and words in err, err
