"""Corpora: the default one (no download) and user files.

The default corpus is the Python standard library's own top-level source files, read as bytes
in sorted order: present on every machine that runs this code. A user may point at a text
file (byte-level tokens), a pre-tokenised binary file of token ids (`.bin`: little-endian
uint16, as nanoGPT writes; `.npy`: any integer array), or a directory of `.bin` shards (what
`elastic prepare-data` writes), read in name order as one stream. Token files are memory-mapped:
a worker reads the windows it samples, never the whole corpus.
"""

from __future__ import annotations

import bisect
import hashlib
import sysconfig
from collections.abc import Sequence
from pathlib import Path

import numpy as np

SCAN_TOKENS = 1 << 24
"""Tokens read at a time when a whole stream is scanned (its largest id, its digest)."""

DEFAULT_CORPUS_BYTES = 4 * 1024 * 1024
"""Size cap of the default corpus."""


def default_corpus(limit: int = DEFAULT_CORPUS_BYTES) -> np.ndarray:
    """Byte tokens of the standard library's top-level `*.py` files, in sorted order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    size = 0
    for path in sorted(stdlib.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= limit:
            break
    if size == 0:
        raise FileNotFoundError(f"no Python source files found under {stdlib} for the default corpus")
    return np.frombuffer(b"".join(chunks)[:limit], dtype=np.uint8)


class TokenStream:
    """Token ids read as one stream from one or more arrays (memory-mapped shards, or arrays in memory)."""

    def __init__(self, parts: Sequence[np.ndarray], *, source: str) -> None:
        self.parts = [p for p in parts if p.size]
        self.source = source
        """What the stream was read from, for messages."""
        self.starts = list(np.cumsum([0, *(p.size for p in self.parts)]).tolist())
        """starts[k]: stream position of part k's first token; starts[-1]: the stream's length."""

    def __len__(self) -> int:
        return int(self.starts[-1])

    def window(self, start: int, length: int) -> np.ndarray:
        """A copy of tokens [start, start + length), across shard boundaries: (length,) of the parts' dtype."""
        if start < 0 or start + length > len(self):
            raise ValueError(f"window [{start}, {start + length}) outside the stream of {len(self)} tokens")
        pieces = []
        k = bisect.bisect_right(self.starts, start) - 1
        while length > 0:
            offset = start - self.starts[k]
            piece = self.parts[k][offset : offset + length]
            pieces.append(piece)
            start, length, k = start + piece.size, length - piece.size, k + 1
        return np.concatenate(pieces) if len(pieces) > 1 else pieces[0].copy()

    def _chunks(self) -> list[np.ndarray]:
        return [p[i : i + SCAN_TOKENS] for p in self.parts for i in range(0, p.size, SCAN_TOKENS)]

    def max_token(self) -> int:
        """The largest id of the stream, read a chunk at a time."""
        return max(int(chunk.max()) for chunk in self._chunks())

    def digest(self) -> str:
        """sha256 of the stream's bytes (each part in its own dtype), read a chunk at a time."""
        h = hashlib.sha256()
        for chunk in self._chunks():
            h.update(np.ascontiguousarray(chunk).tobytes())
        return h.hexdigest()


def _bin_file(path: Path) -> np.ndarray:
    """A nanoGPT `.bin` file memory-mapped as little-endian uint16 (empty files: an empty array)."""
    size = path.stat().st_size
    if size % 2:
        raise ValueError(f"{path}: a .bin token file holds 2-byte ids, but its size {size} is odd")
    return np.memmap(path, dtype="<u2", mode="r") if size else np.zeros(0, dtype="<u2")


def load_corpus(path: str | Path) -> np.ndarray:
    """Token ids of a user corpus file: `.bin` (uint16, memory-mapped), `.npy` (integers) or any
    other file as bytes."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"corpus file {p} does not exist")
    if p.suffix == ".bin":
        tokens = _bin_file(p)
    elif p.suffix == ".npy":
        tokens = np.load(p, allow_pickle=False, mmap_mode="r")
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"{p}: a .npy corpus must be a 1-D integer array, got {tokens.dtype} {tokens.shape}")
        if tokens.size and tokens.min() < 0:
            raise ValueError(f"{p}: token ids must be non-negative")
    else:
        tokens = np.frombuffer(p.read_bytes(), dtype=np.uint8)
    return tokens


def open_corpus(path: str | Path | None) -> TokenStream:
    """The token stream of `--data`: None for the default corpus, a file (`load_corpus`), or a
    directory whose `.bin` shards, in name order, are read as one stream."""
    if path is None:
        return TokenStream([default_corpus()], source="default (python stdlib sources)")
    p = Path(path)
    if not p.is_dir():
        return TokenStream([load_corpus(p)], source=str(p))
    shards = sorted(q for q in p.iterdir() if q.suffix == ".bin" and q.is_file())
    if not shards:
        raise FileNotFoundError(f"corpus directory {p} holds no .bin token files")
    return TokenStream([_bin_file(q) for q in shards], source=f"{p} ({len(shards)} shards)")
