"""Token data whose samples are fixed by (corpus, seed, index) alone."""

from elastic.data.dataset import TokenDataset, step_sample_indices

__all__ = ["TokenDataset", "step_sample_indices"]
