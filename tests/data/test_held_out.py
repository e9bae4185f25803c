"""The held-out split: windows no training step ever sees, and training unchanged without it."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch

from elastic.data import TokenDataset, step_sample_indices
from elastic.data.dataset import HELD_OUT_FRACTION

pytestmark = pytest.mark.timeout(60)

SEQ_LEN = 16


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """A token file whose every position holds a distinct id: a window's ids are its positions."""
    path = tmp_path / "positions.npy"
    np.save(path, np.arange(5000, dtype=np.int64))
    return path


def test_held_out_windows_are_disjoint_from_every_training_window(corpus: Path) -> None:
    ds = TokenDataset(seq_len=SEQ_LEN, seed=7, path=corpus, held_out=True)
    assert ds.train_end == 5000 - int(5000 * HELD_OUT_FRACTION)
    held_x, held_y = ds.held_out_batch(range(64))
    held = set(held_x.flatten().tolist()) | set(held_y.flatten().tolist())  # token positions
    assert min(held) >= ds.train_end
    # Every training sample of steps 0..499 (global batch 8), read the way the engine reads them.
    for step in range(500):
        x, y = ds.batch(step_sample_indices(step, 8))
        seen = set(x.flatten().tolist()) | set(y.flatten().tolist())
        assert not seen & held, f"step {step} trains on held-out positions {sorted(seen & held)[:5]}"
        assert max(seen) < ds.train_end
    # And the bound is structural: no training window can start late enough to reach the tail.
    assert max(ds.window_start(i) for i in range(20_000)) + SEQ_LEN + 1 <= ds.train_end
    assert min(ds.held_out_start(i) for i in range(2000)) >= ds.train_end


def test_held_out_samples_are_fixed_by_index(corpus: Path) -> None:
    a = TokenDataset(seq_len=SEQ_LEN, seed=7, path=corpus, held_out=True)
    b = TokenDataset(seq_len=SEQ_LEN, seed=7, path=corpus, held_out=True)
    whole, _ = a.held_out_batch(range(4, 10))
    for i in range(4, 10):
        assert torch.equal(b.held_out_batch([i])[0][0], whole[i - 4])
    x, y = a.held_out_batch([3])
    assert torch.equal(x[0, 1:], y[0, :-1])  # targets are inputs shifted by one


def test_training_samples_unchanged_without_evaluation(corpus: Path) -> None:
    """Without held_out the windows are those of the formula every earlier run used."""
    ds = TokenDataset(seq_len=SEQ_LEN, seed=3, path=corpus)
    assert ds.train_end == 5000
    for i in range(200):
        digest = hashlib.sha256(f"3:{i}".encode()).digest()
        assert ds.window_start(i) == int.from_bytes(digest[:8], "little") % (5000 - SEQ_LEN - 1)
    with pytest.raises(ValueError, match="reserves no held-out split"):
        ds.held_out_batch([0])
    assert ds.fingerprint != TokenDataset(seq_len=SEQ_LEN, seed=3, path=corpus, held_out=True).fingerprint


def test_a_corpus_too_small_to_hold_out_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "small.txt"
    path.write_bytes(bytes(range(150)))  # 150 tokens: a tail of 15 cannot hold a window of 18
    TokenDataset(seq_len=SEQ_LEN, path=path)  # fine without evaluation
    with pytest.raises(ValueError, match="held-out tail"):
        TokenDataset(seq_len=SEQ_LEN, path=path, held_out=True)
