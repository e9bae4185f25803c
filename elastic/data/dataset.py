"""A dataset in which global sample i depends only on (corpus, seed, i).

Sample i is the window of seq_len + 1 tokens starting at an offset drawn from a hash of
(seed, i): no layout, worker or read order can change what a sample holds. Step s of a
global batch B consumes samples [s*B, (s+1)*B).

The windows may be confined to a range of the token stream (`token_range`).

The held-out split (`held_out=True`, a job with `--eval-every`): the last HELD_OUT_FRACTION of
the (range of the) token stream is reserved. Training windows are drawn from the tokens before it
and held-out windows (`held_out_batch`) from the tokens in it, so no training sample of any step
shares a token position with a held-out sample. Without `held_out` nothing is reserved and the
training samples are exactly those of earlier versions (the equivalence tests' references stand);
with it the training samples differ from a run without evaluation, so compare runs with
evaluation only with runs with evaluation.
"""

from __future__ import annotations

import functools
import hashlib
import math
from pathlib import Path

import numpy as np
import torch

from elastic.data.corpus import open_corpus


def step_sample_indices(step: int, global_batch: int) -> range:
    """Global sample indices consumed by optimizer step `step`."""
    if step < 0 or global_batch < 1:
        raise ValueError(f"need step >= 0 and global_batch >= 1, got step={step}, global_batch={global_batch}")
    return range(step * global_batch, (step + 1) * global_batch)


HELD_OUT_FRACTION = 0.1
"""Share of the token stream (its tail) reserved for held-out windows when a job evaluates."""


class TokenDataset:
    """Fixed-length training windows over a token corpus (a file, a directory of shards, or the default)."""

    def __init__(
        self,
        *,
        seq_len: int,
        seed: int = 0,
        path: str | Path | None = None,
        token_range: tuple[int, int] | None = None,
        held_out: bool = False,
    ) -> None:
        """`token_range` = (first, end): every window lies inside tokens [first, end) of the
        stream; None: the whole stream. `held_out`: reserve the tail of that range for held-out
        windows (module doc)."""
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
        self.held_out = held_out
        self.train_end = self._split()
        """Training windows lie in tokens [first, train_end); held-out ones in [train_end, end)."""

    def _split(self) -> int:
        """Where the training region ends (`end` without `held_out`)."""
        if not self.held_out:
            return self.end
        size = self.end - self.first
        train_end = self.end - math.ceil(size * HELD_OUT_FRACTION)
        need = self.seq_len + 2
        if min(train_end - self.first, self.end - train_end) < need:
            raise ValueError(
                f"corpus {self.source} has {size} tokens: its held-out tail ({HELD_OUT_FRACTION:.0%}) and the "
                f"training part must each hold at least {need} tokens (seq_len={self.seq_len} + 2)"
            )
        return train_end

    @functools.cached_property
    def fingerprint(self) -> str:
        """What fixes every sample: the corpus's digest (a full read of it), the seed and seq_len."""
        span = "" if (self.first, self.end) == (0, len(self.stream)) else f":tokens=[{self.first},{self.end})"
        held = ":held_out" if self.held_out else ""
        return f"{self.stream.digest()[:16]}:seed={self.seed}:seq_len={self.seq_len}{span}{held}"

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
        return self.first + int.from_bytes(digest[:8], "little") % (self.train_end - self.first - self.seq_len - 1)

    def window_start(self, index: int) -> int:
        """Token position where training sample `index` starts (its window is seq_len + 1 long)."""
        return self._offset(index)

    def held_out_start(self, index: int) -> int:
        """Token position where held-out sample `index` starts: inside the reserved tail."""
        if not self.held_out:
            raise ValueError("this dataset reserves no held-out split (held_out=False)")
        if index < 0:
            raise ValueError(f"held-out sample index must be >= 0, got {index}")
        digest = hashlib.sha256(f"{self.seed}:held-out:{index}".encode()).digest()
        span = self.end - self.train_end - self.seq_len - 1
        return self.train_end + int.from_bytes(digest[:8], "little") % span

    def held_out_batch(self, indices: range | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of held-out samples, as `batch` gives for training samples."""
        rows = torch.stack([
            torch.from_numpy(self.stream.window(self.held_out_start(i), self.seq_len + 1).astype(np.int64))
            for i in indices
        ])  # (batch, seq_len + 1)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

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
