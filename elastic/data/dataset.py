"""A dataset in which global sample i depends only on (corpus, seed, i).

Sample i is the window of seq_len + 1 tokens starting at an offset drawn from a hash of
(seed, i): no layout, worker or read order can change what a sample holds. Step s of a
global batch B consumes samples [s*B, (s+1)*B).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch

from elastic.data.corpus import default_corpus, load_corpus


def step_sample_indices(step: int, global_batch: int) -> range:
    """Global sample indices consumed by optimizer step `step`."""
    if step < 0 or global_batch < 1:
        raise ValueError(f"need step >= 0 and global_batch >= 1, got step={step}, global_batch={global_batch}")
    return range(step * global_batch, (step + 1) * global_batch)


class TokenDataset:
    """Fixed-length training windows over a token corpus."""

    def __init__(self, *, seq_len: int, seed: int = 0, path: str | Path | None = None) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        tokens = default_corpus() if path is None else load_corpus(path)
        if tokens.size < seq_len + 2:
            raise ValueError(f"corpus has {tokens.size} tokens; windows of seq_len={seq_len} need at least {seq_len + 2}")
        self.tokens = torch.from_numpy(tokens.astype(np.int64))
        self.seq_len = seq_len
        self.seed = seed
        self.source = "default (python stdlib sources)" if path is None else str(path)
        digest = hashlib.sha256(tokens.tobytes()).hexdigest()[:16]
        self.fingerprint = f"{digest}:seed={seed}:seq_len={seq_len}"

    @property
    def max_token(self) -> int:
        return int(self.tokens.max().item())

    def check_vocab(self, vocab_size: int) -> None:
        """ValueError when the corpus holds a token id the model cannot embed."""
        if self.max_token >= vocab_size:
            raise ValueError(f"corpus {self.source} holds token id {self.max_token} >= the model's vocab_size={vocab_size}")

    def _offset(self, index: int) -> int:
        digest = hashlib.sha256(f"{self.seed}:{index}".encode()).digest()
        return int.from_bytes(digest[:8], "little") % (self.tokens.numel() - self.seq_len - 1)

    def sample(self, index: int) -> torch.Tensor:
        """Tokens of global sample `index`: (seq_len + 1,) int64."""
        if index < 0:
            raise ValueError(f"sample index must be >= 0, got {index}")
        start = self._offset(index)
        return self.tokens[start : start + self.seq_len + 1]

    def batch(self, indices: range | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (len(indices), seq_len) int64; targets are inputs shifted by one."""
        rows = torch.stack([self.sample(i) for i in indices])  # (batch, seq_len + 1)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
