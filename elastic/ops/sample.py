"""Text from a trained model (`elastic sample`): a small, honest proof that it is a model.

`generate` runs the whole model (one process, no tensor parallelism, dropout off) on the last
`seq_len` tokens of the text so far and picks the next token: the most likely one when
`top_k` is 1 or `temperature` is 0 (greedy), else a draw from the `top_k` most likely after
dividing the logits by `temperature`, from a generator seeded with `seed`. No key/value cache:
each token costs one forward over the window, which is plenty for a proof.

Tokens: a run on byte-level text (the built-in corpus, a text file) reads and writes bytes
(`ByteCodec`, invalid UTF-8 shown as U+FFFD); a run on prepared data uses the `tokenizer.json`
that came with it (`TokenizerCodec`, Hugging Face `tokenizers`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from elastic.model.config import GPTConfig
from elastic.model.gpt import GPTStage


class ByteCodec:
    """Byte-level tokens: token id = byte value."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class TokenizerCodec:
    """A Hugging Face `tokenizers` file (`tokenizer.json`)."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self.path = path
        self.tokenizer = Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids))


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How `generate` picks tokens (module doc)."""

    max_new_tokens: int = 200
    """Tokens to generate after the prompt."""
    top_k: int | None = 40
    """Draw from the k most likely tokens only (None: all; 1: greedy)."""
    temperature: float = 0.8
    """Logits are divided by it before the draw (0: greedy)."""
    seed: int = 0
    """Seed of the draws."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"--max-new-tokens must be >= 0, got {self.max_new_tokens}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"--top-k must be >= 1, got {self.top_k}")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")

    @property
    def greedy(self) -> bool:
        return self.top_k == 1 or self.temperature == 0


def load_model(state: dict[str, torch.Tensor], cfg: GPTConfig) -> GPTStage:
    """The whole model with `state` (canonical names), in eval mode (dropout off)."""
    with torch.device("meta"):
        model = GPTStage(cfg, initialise=False)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


@torch.no_grad()
def generate(model: GPTStage, prompt: list[int], sampling: SamplingConfig) -> list[int]:
    """The `sampling.max_new_tokens` tokens that follow `prompt` (module doc)."""
    cfg = model.cfg
    if not prompt:
        raise ValueError("the prompt encodes to no tokens")
    if max(prompt) >= cfg.vocab_size:
        raise ValueError(f"the prompt has token id {max(prompt)}, outside the model's vocabulary of {cfg.vocab_size}")
    generator = torch.Generator().manual_seed(sampling.seed)
    tokens = list(prompt)
    for _ in range(sampling.max_new_tokens):
        window = torch.tensor([tokens[-cfg.seq_len:]])  # (1, seq <= seq_len)
        logits = model(window, dropout_key=0)[0, -1].float()  # (vocab,)
        if sampling.greedy:
            nxt = int(logits.argmax())
        else:
            logits = logits / sampling.temperature
            if sampling.top_k is not None and sampling.top_k < logits.numel():
                kth = torch.topk(logits, sampling.top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = int(torch.multinomial(logits.softmax(dim=-1), 1, generator=generator))
        tokens.append(nxt)
    return tokens[len(prompt):]
