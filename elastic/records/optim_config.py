"""Optimizer settings and the warmup + cosine learning-rate schedule, without torch.

Kept apart from optim.py so that reading a job's config (agents, the operator CLI) does not
load torch: an agent importing torch while its lease keepalive thread waits for the GIL can
starve the keepalive past the lease TTL on a loaded machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """Optimizer and learning-rate schedule settings."""

    lr: float = 1e-3
    """Peak learning rate, reached at the end of warmup."""
    min_lr: float = 1e-4
    """Learning rate at the end of the cosine decay and after it."""
    warmup_steps: int = 2
    """Steps of linear warmup from lr/warmup_steps to lr."""
    decay_steps: int = 1000
    """Step at which the cosine decay reaches min_lr."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW moment decay rates."""
    eps: float = 1e-6
    """AdamW denominator epsilon. 1e-6 rather than 1e-8: a parameter whose true gradient is zero
    (the attention key bias) would otherwise take lr-sized steps on rounding noise, so runs that
    differ only in reduction order (tensor-parallel degree) would drift apart."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices (2-D and up) only."""
    grad_clip: float = 1.0
    """Global gradient-norm clip (0 disables clipping)."""

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"need 0 <= min_lr <= lr and lr > 0, got lr={self.lr} min_lr={self.min_lr}")
        if self.warmup_steps < 0 or self.decay_steps < self.warmup_steps:
            raise ValueError(
                f"need 0 <= warmup_steps <= decay_steps, got {self.warmup_steps} and {self.decay_steps}"
            )
        if self.grad_clip < 0 or self.weight_decay < 0:
            raise ValueError("grad_clip and weight_decay must be >= 0")


def lr_at(step: int, cfg: OptimConfig) -> float:
    """Learning rate of optimizer step `step` (0-based)."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if step >= cfg.decay_steps:
        return cfg.min_lr
    span = max(1, cfg.decay_steps - cfg.warmup_steps)
    progress = (step - cfg.warmup_steps) / span
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))
