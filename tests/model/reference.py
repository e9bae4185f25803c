"""Comparison helpers for tests against a reference."""

from __future__ import annotations

import torch


def max_rel_diff(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref| (absolute difference when ref is all zeros)."""
    if got.shape != ref.shape:
        raise AssertionError(f"shape {tuple(got.shape)} != reference {tuple(ref.shape)}")
    scale = ref.abs().max().item()
    diff = (got.double() - ref.double()).abs().max().item()
    return diff / scale if scale > 0 else diff


def assert_close(got: torch.Tensor, ref: torch.Tensor, tol: float, what: str) -> None:
    rel = max_rel_diff(got, ref)
    assert rel <= tol, f"{what}: relative difference {rel:.3e} > {tol:.0e}"
