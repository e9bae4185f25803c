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


def test_a_directory_of_shards_reads_as_their_concatenation(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    whole = rng.integers(0, 60000, size=5000).astype("<u2")
    shards = tmp_path / "shards"
    shards.mkdir()
    cuts = [0, 1, 700, 700, 2345, 4999, 5000]  # an empty shard and a one-token shard among them
    for k, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False)):
        whole[a:b].tofile(shards / f"part-{k:03d}.bin")  # names sort in stream order
    (shards / "notes.txt").write_text("not a shard")  # only .bin files are read
    ds = TokenDataset(seq_len=64, path=shards, seed=1)
    assert len(ds.stream) == whole.size and ds.max_token == int(whole.max())
    assert np.array_equal(ds.stream.window(0, whole.size), whole)
    for start in (0, 1, 650, 699, 2300, 4935):  # windows across every shard boundary
        assert np.array_equal(ds.stream.window(start, 65), whole[start : start + 65])
    for i in range(200):
        start = ds._offset(i)
        assert ds.sample(i).tolist() == whole[start : start + 65].tolist()
    # the same tokens in one file: the same samples (samples depend on the tokens, not the files)
    one = tmp_path / "one.bin"
    whole.tofile(one)
    assert torch.equal(TokenDataset(seq_len=64, path=one, seed=1).batch(range(30))[0], ds.batch(range(30))[0])
    assert TokenDataset(seq_len=64, path=one, seed=1).fingerprint == ds.fingerprint
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="holds no .bin token files"):
        TokenDataset(seq_len=8, path=empty)
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(ValueError, match="size 3 is odd"):
        TokenDataset(seq_len=8, path=tmp_path / "odd.bin")


def test_a_token_range_confines_every_window(tmp_path: Path) -> None:
    """The held-out split hook: windows of a range never leave it."""
    ids = np.arange(3000, dtype="<u2")
    ids.tofile(tmp_path / "ids.bin")
    held_out = TokenDataset(seq_len=16, path=tmp_path / "ids.bin", token_range=(2500, 3000))
    train = TokenDataset(seq_len=16, path=tmp_path / "ids.bin", token_range=(0, 2500))
    for i in range(300):
        assert held_out.sample(i).min() >= 2500 and held_out.sample(i).max() < 3000
        assert train.sample(i).max() < 2500
    with pytest.raises(ValueError, match="outside the corpus"):
        TokenDataset(seq_len=16, path=tmp_path / "ids.bin", token_range=(0, 3001))
    with pytest.raises(ValueError, match="need at least 18"):
        TokenDataset(seq_len=16, path=tmp_path / "ids.bin", token_range=(100, 110))
