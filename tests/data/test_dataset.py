"""Samples depend only on (corpus, seed, index): never on batch composition or reader."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from elastic.data import TokenDataset, step_sample_indices

pytestmark = pytest.mark.timeout(60)


def test_sample_is_fixed_by_index_whatever_the_batch() -> None:
    a = TokenDataset(seq_len=32, seed=3)
    b = TokenDataset(seq_len=32, seed=3)  # another reader of the same corpus
    whole_x, whole_y = a.batch(range(10, 18))
    for i in range(10, 18):
        x, y = b.batch([i])
        assert torch.equal(x[0], whole_x[i - 10]) and torch.equal(y[0], whole_y[i - 10])
    assert torch.equal(whole_x[:, 1:], whole_y[:, :-1])  # targets are inputs shifted by one
    other_seed = TokenDataset(seq_len=32, seed=4).batch(range(10, 18))[0]
    assert not torch.equal(other_seed, whole_x)


def test_steps_partition_the_sample_stream() -> None:
    assert list(step_sample_indices(2, 4)) == [8, 9, 10, 11]
    with pytest.raises(ValueError):
        step_sample_indices(-1, 4)


def test_user_text_and_token_files(tmp_path: Path) -> None:
    text = tmp_path / "corpus.txt"
    text.write_bytes(bytes(range(200)) * 3)
    ds = TokenDataset(seq_len=16, path=text)
    x, _ = ds.batch([0])
    start = x[0, 0].item()
    assert x[0].tolist() == [(start + k) % 200 for k in range(16)]  # a real window of the file
    ids = np.arange(1000, 1600, dtype="<u2")
    ids.tofile(tmp_path / "tokens.bin")
    tok = TokenDataset(seq_len=8, path=tmp_path / "tokens.bin")
    assert tok.max_token == 1599
    with pytest.raises(ValueError, match="token id 1599 >= the model's vocab_size=256"):
        tok.check_vocab(256)
    with pytest.raises(ValueError, match="need at least"):
        TokenDataset(seq_len=1000, path=text)
    with pytest.raises(FileNotFoundError):
        TokenDataset(seq_len=8, path=tmp_path / "missing.txt")
