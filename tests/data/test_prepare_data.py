"""`elastic prepare-data`: the tokenizer round-trips the text, the shards hold exactly the
tokenizer's encoding of the inputs, `--data DIR` reads them back as one stream, and bad input
is one line, exit 2, with nothing written."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from elastic.cli.main import main
from elastic.cli.prepare_data_cmd import ProgressBar
from elastic.data import TokenDataset
from elastic.data.corpus import open_corpus
from elastic.data.prepare import SEPARATOR, ShardWriter, encode_file, text_chunks, train_tokenizer
from elastic.records.prepared_data import PreparedData

pytestmark = pytest.mark.timeout(120)

TEXT = (
    "def add(a, b):\n    return a + b\n\n\n"
    "Élan, naïve façade — 東京 and emoji 😀 at the end of a line  \n"
    "\ttabs\tand  double  spaces\r\nwindows line\r\n"
    "numbers 12345 67890, punctuation!? ...\n"
) * 40 + "no newline at the end"


def _tokens(directory: Path) -> np.ndarray:
    """Every token id of a prepared directory's shards, in name order (read directly, not via elastic.data)."""
    return np.concatenate([np.fromfile(p, dtype="<u2") for p in sorted(directory.glob("*.bin"))])


def test_prepare_data_round_trips_and_data_reads_the_same_tokens(tmp_path: Path) -> None:
    text = tmp_path / "corpus.txt"
    text.write_text(TEXT, encoding="utf-8")
    out = tmp_path / "prepared"
    assert main(["prepare-data", str(text), "--out", str(out), "--vocab-size", "300", "--shard-tokens", "700"]) == 0

    meta = PreparedData.find(out)
    assert meta is not None and meta.vocab_size <= 300 and len(meta.shards) >= 3
    ids = _tokens(out)
    assert meta.tokens == ids.size == meta.sources[0].tokens and int(ids.max()) < meta.vocab_size
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tokenizer.decode(ids.tolist()) == TEXT  # the byte-level BPE is exactly reversible
    assert ids.tolist() == tokenizer.encode(TEXT, add_special_tokens=False).ids  # chunks = the whole text

    stream = open_corpus(out)  # --data DIR: the shards as one stream
    assert len(stream) == ids.size
    assert np.array_equal(stream.window(0, ids.size), ids)
    ds = TokenDataset(seq_len=16, path=out, seed=5)
    assert ds.max_token == int(ids.max())
    for i in range(50):  # every sample is the window of the token stream at its offset
        start = ds._offset(i)
        assert ds.sample(i).tolist() == ids[start : start + 17].tolist()


def test_two_inputs_are_separated_and_an_existing_tokenizer_gives_the_same_tokens(tmp_path: Path) -> None:
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(TEXT[:3000], encoding="utf-8")
    b.write_text(TEXT[3000:], encoding="utf-8")
    first, second = tmp_path / "first", tmp_path / "second"
    assert main(["prepare-data", str(a), str(b), "--out", str(first), "--vocab-size", "320"]) == 0
    meta = PreparedData.find(first)
    assert meta is not None and meta.separator_id == 0 and [s.tokens for s in meta.sources][0] > 0
    ids = _tokens(first)
    n_a = meta.sources[0].tokens
    assert ids[n_a] == meta.separator_id and meta.tokens == n_a + 1 + meta.sources[1].tokens
    tokenizer = Tokenizer.from_file(str(first / "tokenizer.json"))
    assert tokenizer.decode(ids[:n_a].tolist()) == TEXT[:3000]
    assert tokenizer.decode(ids[n_a + 1 :].tolist()) == TEXT[3000:]
    assert tokenizer.decode(ids.tolist(), skip_special_tokens=False) == TEXT[:3000] + SEPARATOR + TEXT[3000:]

    tok = str(first / "tokenizer.json")
    assert main(["prepare-data", str(a), str(b), "--out", str(second), "--tokenizer", tok]) == 0
    assert np.array_equal(_tokens(second), ids)
    again = PreparedData.find(second)
    assert again is not None and again.vocab_size == meta.vocab_size and again.tokenizer_origin.endswith("tokenizer.json")


def test_chunked_encoding_equals_whole_text_encoding(tmp_path: Path) -> None:
    """Cut points never change the encoding, whatever the chunk size (here far smaller than the text)."""
    text = tmp_path / "t.txt"
    text.write_text(TEXT, encoding="utf-8")
    tokenizer = train_tokenizer([text], vocab_size=400)
    whole = tokenizer.encode(TEXT, add_special_tokens=False).ids
    for chunk_chars in (1, 7, 64, 1000):
        chunks = [c for c, _ in text_chunks(text, chunk_chars=chunk_chars)]
        assert "".join(chunks) == TEXT and len(chunks) > 1
        out = tmp_path / f"chunks{chunk_chars}"
        out.mkdir()
        writer = ShardWriter(directory=out, shard_tokens=10**9)
        count = encode_file(tokenizer, text, writer, chunk_chars=chunk_chars)
        assert writer.finish() == [("tokens-00000.bin", count)]
        assert count == len(whole) and _tokens(out).tolist() == whole


def _fails(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.txt"
    good.write_text(TEXT, encoding="utf-8")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9 au lait\n".encode("latin-1") * 10)
    out = tmp_path / "out"
    _fails(capsys, ["prepare-data", str(tmp_path / "missing.txt"), "--out", str(out)], "is not a file")
    _fails(capsys, ["prepare-data", str(good), "--out", str(out), "--vocab-size", "100"], "--vocab-size must be in")
    _fails(capsys, ["prepare-data", str(good), "--out", str(out), "--vocab-size", "70000"], "--vocab-size must be in")
    _fails(capsys, ["prepare-data", str(good), "--out", str(out), "--vocab-size", "300", "--tokenizer", str(good)],
           "give one of them")
    _fails(capsys, ["prepare-data", str(good), "--out", str(out), "--tokenizer", str(good)], "not a tokenizers JSON file")
    _fails(capsys, ["prepare-data", str(good), str(latin1), "--out", str(out), "--vocab-size", "300"],
           f"cannot train a tokenizer on the inputs: input {latin1} is not UTF-8 text")
    assert not out.exists()
    assert main(["prepare-data", str(good), "--out", str(out), "--vocab-size", "300"]) == 0
    capsys.readouterr()
    other = tmp_path / "other"  # an existing tokenizer on a file that is not UTF-8: found while encoding
    _fails(capsys, ["prepare-data", str(good), str(latin1), "--out", str(other), "--tokenizer", str(out / "tokenizer.json")],
           f"input {latin1} is not UTF-8 text")
    assert not other.exists()
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    _fails(capsys, ["prepare-data", str(good), "--out", str(out), "--vocab-size", "300"], "is not an empty directory")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_progress_bar_lines() -> None:
    stream = io.StringIO()  # not a terminal: one line per tenth, then 100% once
    bar = ProgressBar(total=1000, label="tokenizing", stream=stream, width=10)
    for done in range(0, 1001, 50):
        bar.update(done)
    bar.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 11 and lines[-1].startswith("tokenizing [##########] 100%")
    assert lines[5].startswith("tokenizing [#####.....]  50%") and "0.0/0.0 MiB" in lines[5]
    assert json.dumps(lines)  # plain text, no carriage returns
    assert not any("\r" in line for line in lines)
