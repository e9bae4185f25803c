"""The Llama-family model (`--model llama-tiny` with one key/value head, shared by the two tensor-
parallel ranks of a node: issue 58) through the whole runtime, on real processes: 4 nodes x 2
workers (tensor parallel 2, sequence-parallel), f = 1, node 3 SIGKILLed at step 9 and recovered
without restart. It ends bit for bit as the failure-free run, which trains as the same job
without tensor parallelism does (losses, gradient norms, so the shared head counted once, and
final parameters to 1e-5); its export loads in transformers' LlamaForCausalLM with this
project's logits (1e-5 of their scale), and `elastic sample`'s greedy text is a greedy decode
with that transformers model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from elastic.model.config import get_preset
from elastic.ops.sample import load_model
from tests.faults.cli_runs import CliResult, cli_in_process, run_cli, same_bits
from tests.faults.runs import max_rel_diff

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

transformers = pytest.importorskip("transformers")

STEPS = 10
CFG = get_preset("llama-tiny").with_overrides(n_kv_heads=1)
SHAPE = Path(__file__).with_name("llama_shared_kv.json")
"""{"n_kv_heads": 1}: eight query heads on one key/value head."""
JOB = ["--model", "llama-tiny", "--model-config", str(SHAPE), "--nodes", "4", "--fault-tolerance", "1",
       "--global-batch", "8", "--microbatch", "1", "--steps", str(STEPS), "--device", "cpu", "--checkpoint-every", "0",
       "--lease-ttl", "30"]
"""As tests/faults/test_recompute_run.py's job (a long lease: the node's own monitor sees the kill)."""
RUN = [sys.executable, "-m", "elastic.cli", "run", *JOB, "--gpus-per-node", "2"]
KILL = ("--inject", "kill:node=3,step=9")


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> tuple[CliResult, Path]:
    run_dir = tmp_path_factory.mktemp("llama-kill")
    return run_cli([*RUN, *KILL], run_dir, committed=STEPS, lost=[[3]], timeout=200), run_dir


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> CliResult:
    return run_cli(RUN, tmp_path_factory.mktemp("llama-ref"), committed=STEPS, lost=[], timeout=200)


def test_a_failure_ends_as_the_failure_free_run(killed: tuple[CliResult, Path], reference: CliResult) -> None:
    same_bits(killed[0], reference, "llama-tiny, node 3 killed at step 9")
    losses = killed[0][0]["losses"]
    assert losses[-1] < losses[0] - 0.5, losses  # it trains


def test_the_shared_head_trains_as_without_tensor_parallelism(reference: CliResult, tmp_path: Path) -> None:
    whole = run_cli([sys.executable, "-m", "elastic.cli", "run", *JOB, "--gpus-per-node", "1"], tmp_path,
                    committed=STEPS, lost=[], timeout=200)
    assert reference[0]["model"]["n_kv_heads"] == 1
    for what in ("losses", "grad_norms"):  # the norm: the shared head counted once
        for step, (got, want) in enumerate(zip(reference[0][what], whole[0][what], strict=True)):
            assert abs(got - want) <= 1e-5 * abs(want), (what, step + 1, got, want)
    assert max_rel_diff(reference[1], whole[1]) <= 1e-5


def test_the_export_is_this_model_in_transformers(killed: tuple[CliResult, Path], tmp_path: Path) -> None:
    (_, state, _), run_dir = killed
    code, out, err = cli_in_process("export", str(run_dir), "--format", "hf", str(tmp_path / "hf"))
    assert code == 0, err
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert hf.config.num_key_value_heads == CFG.kv_heads < hf.config.num_attention_heads
    ours = load_model(state, CFG)
    for seq in (list(range(CFG.seq_len)), [ord(c) for c in "def elastic(nodes):"], [255, 0, 17]):
        with torch.no_grad():
            want = hf(torch.tensor([seq])).logits[0]
            got = ours(torch.tensor([seq]), dropout_key=0)[0]
        assert float((got - want).abs().max() / want.abs().max()) <= 1e-5
    prompt, new = "def main(", 70  # past the 64-token window
    tokens = list(prompt.encode())
    with torch.no_grad():
        for _ in range(new):
            tokens.append(int(hf(torch.tensor([tokens[-CFG.seq_len:]])).logits[0, -1].argmax()))
    want_text = prompt + bytes(tokens[len(prompt):]).decode("utf-8", "replace")
    code, out, err = cli_in_process("sample", str(run_dir), "--prompt", prompt, "--max-new-tokens", str(new), "--top-k", "1")
    assert code == 0, err
    assert out == want_text + "\n", (out, want_text)
