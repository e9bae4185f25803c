"""`elastic prepare-data` then `elastic run --data DIR --model-config FILE`: a model of the user's
own shape trains on the user's own tokens under the control plane. The vocabulary defaults to
the tokenizer's, a model that cannot embed every id is refused (one line, exit 2), and the
summary and final state carry the shape."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from elastic.cli.main import main
from elastic.model.config import GPTConfig
from elastic.model.gpt import GPTStage
from elastic.records.prepared_data import PreparedData

pytestmark = [pytest.mark.slow]

SHAPE = {"n_layer": 2, "d_model": 64, "n_head": 4, "seq_len": 32}
VOCAB = 512


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A prepared directory of a few of the standard library's sources (text made in the test)."""
    root = tmp_path_factory.mktemp("prepared")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = root / "corpus.txt"
    text.write_text("".join((stdlib / name).read_text() for name in ("textwrap.py", "shlex.py", "glob.py")))
    out = root / "data"
    assert main(["prepare-data", str(text), "--out", str(out), "--vocab-size", str(VOCAB), "--shard-tokens",
                 "5000"]) == 0
    return out


def elastic_run(*args: str, timeout: float = 200) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "elastic.cli", "run", "--device", "cpu", "--no-report", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(300)
def test_a_custom_shape_trains_on_prepared_data(prepared: Path, tmp_path: Path) -> None:
    meta = PreparedData.find(prepared)
    assert meta is not None and meta.vocab_size == VOCAB and len(meta.shards) > 1
    config = tmp_path / "model.json"
    config.write_text(json.dumps(SHAPE))
    summary_path, state_path = tmp_path / "summary.json", tmp_path / "state.pt"
    out = elastic_run(
        "--data", str(prepared), "--model-config", str(config), "--nodes", "2", "--fault-tolerance", "1",
        "--global-batch", "8", "--microbatch", "2", "--steps", "30", "--lr", "3e-3", "--warmup-steps", "2",
        "--run-dir", str(tmp_path / "run"), "--summary", str(summary_path), "--final-state", str(state_path),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "elastic run: tiny (vocab_size=512, seq_len=32, n_layer=2, d_model=64)," in out.stdout
    summary = json.loads(summary_path.read_text())
    cfg = GPTConfig(**{**SHAPE, "vocab_size": VOCAB})
    assert summary["model"] == {**cfg.as_dict(), "num_params": cfg.num_params()}
    assert summary["seq_len"] == 32 and summary["steps_committed"] == 30
    losses = summary["losses"]
    assert losses[0] == pytest.approx(math.log(VOCAB), abs=0.3)  # near uniform over the tokenizer's ids at init
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses  # it learns the user's tokens
    # the workers built this shape: the final state has exactly the parameters of a model of it
    state = torch.load(state_path, weights_only=True)
    reference = GPTStage(cfg, initialise=False, device="meta").state_dict()
    assert {n: tuple(t.shape) for n, t in state.items()} == {n: tuple(t.shape) for n, t in reference.items()}
    assert state["embed.wte.weight"].shape == (VOCAB, 64)


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--vocab-size", "300"], "the model's vocab_size=300 does not cover the tokenizer of --data"),
        (["--seq-len", "100000"], "windows of seq_len=100000 need at least 100002"),
        (["--gpus-per-node", "2", "--n-head", "3", "--d-model", "96"], "n_head=3 is not divisible by --gpus-per-node 2"),
        (["--d-model", "100", "--n-head", "3"], "d_model=100 is not divisible by n_head=3"),
    ],
)
def test_bad_runs_on_prepared_data_exit_2_with_one_line(prepared: Path, flags: list[str], message: str) -> None:
    out = elastic_run("--data", str(prepared), *flags, timeout=150)
    assert out.returncode == 2, out.stderr
    assert message in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
