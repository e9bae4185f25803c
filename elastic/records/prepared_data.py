"""The description of a prepared data directory: `<dir>/meta.json`, written by `elastic prepare-data`.

A prepared directory holds the token shards (`tokens-00000.bin`, ...: nanoGPT's little-endian
uint16 token ids, read by `--data DIR` as one stream in name order), the tokenizer that made them
(`tokenizer.json`, Hugging Face `tokenizers` format) and this record: the vocabulary size a model
needs to embed every id, the token count, the shards and the source files. `elastic run --data DIR`
reads it to default the model's vocabulary to the tokenizer's and to refuse a model that cannot
embed every id; anything else that needs the vocabulary (evaluation, sampling, export) reads it
here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from elastic.coordinator.jsonrecord import JsonRecord, RecordError

META_NAME = "meta.json"
"""The record's file name inside a prepared directory."""
TOKENIZER_NAME = "tokenizer.json"
"""The tokenizer's file name inside a prepared directory."""
TOKEN_DTYPE = "uint16"
"""The token file format: nanoGPT's `.bin`, little-endian uint16, so ids must be < 65536."""
MAX_VOCAB = 2**16
"""Largest vocabulary the uint16 token files can hold."""


@dataclass(frozen=True, kw_only=True)
class ShardInfo:
    """One token file of the directory."""

    name: str
    """File name inside the directory."""
    tokens: int
    """Token ids in the file (its size is 2 bytes per id)."""


@dataclass(frozen=True, kw_only=True)
class SourceInfo:
    """One input text file and what it became."""

    path: str
    """The file as given on the command line, resolved to an absolute path."""
    bytes: int
    """Size of the file."""
    tokens: int
    """Token ids it was encoded to (the separator before it not counted)."""


@dataclass(frozen=True, kw_only=True)
class PreparedData(JsonRecord):
    """What a prepared data directory holds (its meta.json)."""

    vocab_size: int
    """Every token id is below this: the smallest `vocab_size` of a model that embeds them all."""
    tokens: int
    """Token ids in all shards together."""
    shards: list[ShardInfo]
    """The token files, in stream order (= name order)."""
    sources: list[SourceInfo]
    """The input text files, in the order they were encoded."""
    tokenizer: str = TOKENIZER_NAME
    """The tokenizer's file name inside the directory."""
    tokenizer_origin: str = ""
    """"trained: byte-level BPE, target vocabulary N", or the `--tokenizer` file it was copied from."""
    separator_id: int | None = None
    """Id of `<|endoftext|>`, written between two source files; None: the tokenizer has none and
    the files follow each other directly."""
    dtype: str = TOKEN_DTYPE
    """Element type of the token files."""

    def __post_init__(self) -> None:
        if not 0 < self.vocab_size <= MAX_VOCAB:
            raise ValueError(f"vocab_size must be in [1, {MAX_VOCAB}], got {self.vocab_size}")
        if self.dtype != TOKEN_DTYPE:
            raise ValueError(f"dtype must be {TOKEN_DTYPE!r}, got {self.dtype!r}")
        if self.tokens != sum(s.tokens for s in self.shards):
            raise ValueError(f"tokens={self.tokens} is not the sum of the shards' tokens")

    def save(self, directory: str | Path) -> Path:
        """Write meta.json into `directory` (last, once the shards are complete); its path."""
        path = Path(directory) / META_NAME
        path.write_text(self.to_json(indent=1) + "\n")
        return path

    @classmethod
    def find(cls, data: str | Path | None) -> PreparedData | None:
        """The record of `--data` when it is a prepared directory; None for a file, a directory of
        shards without meta.json, or no data. ValueError (RecordError) for a meta.json that cannot
        be read."""
        if data is None or not Path(data).is_dir():
            return None
        path = Path(data) / META_NAME
        if not path.is_file():
            return None
        try:
            return cls.from_json(path.read_bytes())
        except RecordError as exc:
            raise ValueError(f"{path}: {exc}") from None

    def check_model(self, *, vocab_size: int, seq_len: int, where: str) -> None:
        """ValueError unless a model of `vocab_size` embeds every id of the data and a window of
        `seq_len` + 1 tokens fits in it (`where` names the data in the message)."""
        if vocab_size < self.vocab_size:
            raise ValueError(
                f"the model's vocab_size={vocab_size} does not cover the tokenizer of {where} "
                f"({self.vocab_size} ids): leave --vocab-size out, or make it at least {self.vocab_size}"
            )
        if self.tokens < seq_len + 2:
            raise ValueError(f"{where} holds {self.tokens} tokens; windows of seq_len={seq_len} need at least {seq_len + 2}")
