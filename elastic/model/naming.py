"""Canonical parameter names -> planning layers."""

from __future__ import annotations

from elastic.model.config import GPTConfig

EMBEDDING = "embed.wte.weight"
HEAD = "head.lm_head.weight"
"""The token embedding and the output head's weight: the two copies of one matrix where the model
ties them (`GPTConfig.tie_embeddings`, elastic/parallel/tied.py)."""


def layer_of(name: str, cfg: GPTConfig) -> int:
    """Planning layer that holds the canonical parameter `name`."""
    root, _, rest = name.partition(".")
    if root == "embed":
        return 0
    if root == "head":
        return cfg.num_layers - 1
    if root == "blocks":
        block = rest.partition(".")[0]
        if block.isdigit() and int(block) < cfg.n_layer:
            return int(block) + 1
    raise ValueError(f"{name!r} is not a canonical parameter name of this model")
