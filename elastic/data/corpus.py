"""Corpora: the default one (no download) and user files.

The default corpus is the Python standard library's own top-level source files, read as bytes
in sorted order: present on every machine that runs this code. A user may point at a text
file (byte-level tokens) or a pre-tokenised binary file of token ids (`.bin`: little-endian
uint16, as nanoGPT writes; `.npy`: any integer array).
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np

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


def load_corpus(path: str | Path) -> np.ndarray:
    """Token ids of a user corpus: `.bin` (uint16), `.npy` (integers) or any other file as bytes."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"corpus file {p} does not exist")
    if p.suffix == ".bin":
        tokens = np.fromfile(p, dtype="<u2")
    elif p.suffix == ".npy":
        tokens = np.load(p, allow_pickle=False)
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"{p}: a .npy corpus must be a 1-D integer array, got {tokens.dtype} {tokens.shape}")
        if tokens.size and tokens.min() < 0:
            raise ValueError(f"{p}: token ids must be non-negative")
    else:
        tokens = np.frombuffer(p.read_bytes(), dtype=np.uint8)
    return tokens
