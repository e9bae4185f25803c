"""A dataset in which global sample i depends only on (corpus, seed, i).

Sample i is the window of seq_len + 1 tokens starting at an offset drawn from a hash of
(seed, i): no layout, worker or read order can change what a sample holds. Step s of a
global batch B consumes samples [s*B, (s+1)*B).

The windows may be confined to a range of the token stream (`token_range`): the hook of a
held-out split, whose training and evaluation datasets draw from disjoint ranges.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import numpy as np
import torch

from elastic.data.corpus import open_corpus


def step_sample_indices(step: int, global_batch: int) -> range:
    """Global sample indices consumed by optimizer step `step`."""
    if step < 0 or global_batch < 1:
        raise ValueError(f"need step >= 0 and global_batch >= 1, got step={step}, global_batch={global_batch}")
    return range(step * global_batch, (step + 1) * global_batch)


class TokenDataset:
    """Fixed-length training windows over a token corpus (a file, a directory of shards, or the default)."""

    def __init__(
        self,
        *,
        seq_len: int,
        seed: int = 0,
        path: str | Path | None = None,
        token_range: tuple[int, int] | None = None,
    ) -> None:
        """`token_range` = (first, end): every window lies inside tokens [first, end) of the
        stream; None: the whole stream."""
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.stream = open_corpus(path)
        first, end = (0, len(self.stream)) if token_range is None else token_range
        if not 0 <= first <= end <= len(self.stream):
            raise ValueError(f"token_range {token_range} outside the corpus of {len(self.stream)} tokens")
        if end - first < seq_len + 2:
            raise ValueError(
                f"corpus has {end - first} tokens; windows of seq_len={seq_len} need at least {seq_len + 2}"
            )
        self.first, self.end = first, end
        self.seq_len = seq_len
        self.seed = seed
        self.source = self.stream.source

    @functools.cached_property
    def fingerprint(self) -> str:
        """What fixes every sample: the corpus's digest (a full read of it), the seed and seq_len."""
        span = "" if (self.first, self.end) == (0, len(self.stream)) else f":tokens=[{self.first},{self.end})"
        return f"{self.stream.digest()[:16]}:seed={self.seed}:seq_len={self.seq_len}{span}"

    @functools.cached_property
    def max_token(self) -> int:
        """The corpus's largest token id (a full read of it, once)."""
        return self.stream.max_token()

    def check_vocab(self, vocab_size: int) -> None:
        """ValueError when the corpus holds a token id the model cannot embed."""
        if self.max_token >= vocab_size:
            raise ValueError(f"corpus {self.source} holds token id {self.max_token} >= the model's vocab_size={vocab_size}")

    def _offset(self, index: int) -> int:
        digest = hashlib.sha256(f"{self.seed}:{index}".encode()).digest()
        return self.first + int.from_bytes(digest[:8], "little") % (self.end - self.first - self.seq_len - 1)

    def sample(self, index: int) -> torch.Tensor:
        """Tokens of global sample `index`: (seq_len + 1,) int64."""
        if index < 0:
            raise ValueError(f"sample index must be >= 0, got {index}")
        window = self.stream.window(self._offset(index), self.seq_len + 1)
        return torch.from_numpy(window.astype(np.int64))

    def batch(self, indices: range | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (len(indices), seq_len) int64; targets are inputs shifted by one."""
        rows = torch.stack([self.sample(i) for i in indices])  # (batch, seq_len + 1)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
