"""Text -> token shards: a byte-level BPE tokenizer (Hugging Face `tokenizers`, local and offline)
and the nanoGPT `.bin` files that `--data DIR` reads.

The text is read as UTF-8 a block at a time and encoded in chunks cut only at a newline that
has a non-space character on both sides. The byte-level pre-tokenizer (GPT-2's split into
words, numbers, punctuation and whitespace runs) never joins such a newline to a neighbour, so
the chunked encoding is exactly the encoding of the whole text, while memory stays bounded on
long inputs. A text without such cut points (no line breaks) is held whole, and past
`MAX_CHUNK_FACTOR` times the chunk size cut at any newline.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from tokenizers import Tokenizer

SEPARATOR = "<|endoftext|>"
"""The special token written between two source files (id 0 of a trained tokenizer)."""
CHUNK_CHARS = 1 << 18
"""Characters of text per encoded chunk (at least; a chunk ends at the next cut point)."""
MAX_CHUNK_FACTOR = 16
"""A chunk longer than this many CHUNK_CHARS is cut at any newline."""
READ_BYTES = 1 << 20
"""Bytes read from a text file at a time."""
ENCODE_BATCH = 4
"""Chunks encoded together (the tokenizer spreads a batch over its threads)."""
_CUT = re.compile(r"(?<=\S\n)(?=\S)")
"""A point after a newline with a non-space character on both sides: no pre-token crosses it."""


def train_tokenizer(files: Sequence[Path], *, vocab_size: int, show_progress: bool = False) -> Tokenizer:
    """A byte-level BPE tokenizer trained on `files` (UTF-8 text) to at most `vocab_size` ids:
    `SEPARATOR` (id 0), the 256 byte symbols, then merges. Exactly reversible on any text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 257 + 1:
        raise ValueError(f"--vocab-size must be at least 258 (256 bytes, the separator, one merge), got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[SEPARATOR],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tokenizer.train([str(f) for f in files], trainer)
    return tokenizer


def load_tokenizer(path: Path) -> Tokenizer:
    """A tokenizer from its `tokenizer.json`; ValueError naming the file when it is not one."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises a plain Exception for any unreadable file
        raise ValueError(f"--tokenizer {path}: not a tokenizers JSON file: {str(exc).splitlines()[0]}") from None


def vocab_bound(tokenizer: Tokenizer) -> int:
    """One past the largest id the tokenizer can produce (its vocabulary and added tokens)."""
    return max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1


def cut_point(text: str, start: int) -> int | None:
    """The first cut point at or after `start`, if any (see the module docstring)."""
    match = _CUT.search(text, start)
    if match is not None:
        return match.start()
    if len(text) > MAX_CHUNK_FACTOR * start:
        newline = text.find("\n", start)
        return newline + 1 if 0 <= newline < len(text) - 1 else None
    return None


def text_chunks(path: Path, *, chunk_chars: int = CHUNK_CHARS) -> Iterator[tuple[str, int]]:
    """(chunk, bytes of the file read so far) for consecutive chunks that concatenate to the
    file's text; UnicodeDecodeError when the file is not UTF-8."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    pending, read = "", 0
    with path.open("rb") as f:
        while True:
            raw = f.read(READ_BYTES)
            read += len(raw)
            pending += decoder.decode(raw, final=not raw)
            while len(pending) > chunk_chars:
                cut = cut_point(pending, chunk_chars)
                if cut is None:
                    break
                yield pending[:cut], read
                pending = pending[cut:]
            if not raw:
                if pending:
                    yield pending, read
                return


@dataclass
class ShardWriter:
    """Appends token ids to `<dir>/tokens-NNNNN.bin` files of at most `shard_tokens` ids each,
    written as `.part` files and renamed by `finish`, so no half-written shard looks complete."""

    directory: Path
    """Where the shards go."""
    shard_tokens: int
    """Largest number of ids in one shard."""
    written: list[tuple[str, int]] = field(default_factory=list)
    """(file name, ids) of every shard so far, the last one possibly still open."""

    def write(self, ids: np.ndarray) -> None:
        """Append `ids` (uint16) to the stream, opening new shards as the current one fills."""
        while ids.size:
            if not self.written or self.written[-1][1] == self.shard_tokens:
                self.written.append((f"tokens-{len(self.written):05d}.bin", 0))
            name, count = self.written[-1]
            take = ids[: self.shard_tokens - count]
            with (self.directory / f"{name}.part").open("ab") as f:
                take.astype("<u2").tofile(f)
            self.written[-1] = (name, count + take.size)
            ids = ids[take.size :]

    def finish(self) -> list[tuple[str, int]]:
        """Rename every `.part` shard to its final name; the (name, ids) of each shard."""
        for name, _ in self.written:
            (self.directory / f"{name}.part").rename(self.directory / name)
        return self.written

    def discard(self) -> None:
        """Remove every shard this writer started (a failed preparation leaves nothing behind)."""
        for name, _ in self.written:
            for path in (self.directory / f"{name}.part", self.directory / name):
                path.unlink(missing_ok=True)


def encode_file(
    tokenizer: Tokenizer,
    path: Path,
    writer: ShardWriter,
    *,
    progress: Callable[[int], None] = lambda done: None,
    chunk_chars: int = CHUNK_CHARS,
) -> int:
    """Encode one text file into `writer`; the ids written. `progress(bytes of this file read)`
    after every batch of chunks; UnicodeDecodeError when the file is not UTF-8."""
    written = 0
    batch: list[str] = []

    def flush(read: int) -> int:
        encodings = tokenizer.encode_batch(batch, add_special_tokens=False)
        ids = np.concatenate([np.asarray(e.ids, dtype=np.int64) for e in encodings])
        writer.write(ids.astype(np.uint16))
        progress(read)
        return int(ids.size)

    read = 0
    for chunk, read in text_chunks(path, chunk_chars=chunk_chars):
        batch.append(chunk)
        if len(batch) == ENCODE_BATCH:
            written += flush(read)
            batch = []
    if batch:
        written += flush(read)
    return written
