"""Peer systems the benchmarks compare this runtime against (torchrun restart, torchft)."""
