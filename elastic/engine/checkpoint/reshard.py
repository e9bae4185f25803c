"""Reading a checkpoint at another tensor-parallel degree than the one that wrote it.

Shards on disk are per (layer, tp_rank) (files.py). A run at degree T' reads a step
written at degree T by merging, for each layer it needs, the T shards of every tensor into the
full canonical tensor (concatenated along the parameter's `tp_dim`, a grouped qkv weight's rows
read back by its `tp_layout`; replicated tensors are taken from rank 0) and slicing the full tensor for its own rank with the model's own slicing
(`elastic.model.init.shard_tensor`, the one initialisation uses), so a resharded shard is the
shard the model would hold had it been trained at T' (up to the rounding of TP's sums). The
AdamW moments are sharded exactly like their parameters and are resharded the same way; the
AdamW step count is per shard and carried over.

Which parameters a layer has, their full shapes and split dimensions come from the model itself:
the layer's stage built on the meta device (no memory, no initialisation).
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

from elastic.engine.checkpoint.files import CheckpointError, committed_keys, read_marker, shard_stem, step_dir
from elastic.engine.checkpoint.load import load_shards, shard_metadata
from elastic.engine.checkpoint.slices import KINDS
from elastic.engine.checkpoint.writers import Shards
from elastic.model.config import GPTConfig
from elastic.model.gpt import GPTStage
from elastic.model.init import join_shards, shard_shape, shard_tensor
from elastic.model.kv_layout import KvGroups
from elastic.transfer.shards import ShardKey


class CheckpointMismatch(CheckpointError):
    """A checkpoint of another model shape than the one asked for."""


class Split(NamedTuple):
    """How a parameter is split across tensor-parallel ranks (model/tp_layers.py)."""

    full: tuple[int, ...]
    tp_dim: int | None
    layout: KvGroups | None

    def shard_shape(self, size: int) -> tuple[int, ...] | None:
        """One of `size` shards' shape (None if the split does not divide)."""
        try:
            return shard_shape(self.full, self.tp_dim, size, layout=self.layout)
        except ValueError:
            return None

    def merge(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's shard, in rank order."""
        return join_shards(parts, self.tp_dim, layout=self.layout)


def layer_parameters(cfg: GPTConfig, layer: int) -> dict[str, Split]:
    """Canonical name -> split (full shape, tensor-parallel dimension or None, layout) of every
    parameter of planning layer `layer`, from the model's own layers built on the meta device."""
    with torch.device("meta"):
        stage = GPTStage(cfg, first=layer, last=layer + 1, initialise=False)
    return {name: Split(tuple(p.full_shape), p.tp_dim, p.tp_layout)  # type: ignore[attr-defined]
            for name, p in stage.named_parameters()}


def step_layout(directory: Path, step: int) -> tuple[int, int]:
    """(planning layers, tensor-parallel degree) of the checkpoint of `step`, from its markers;
    CheckpointError when the step is incomplete or its markers disagree."""
    directory = Path(directory)
    keys = committed_keys(directory, step)
    if not keys:
        raise CheckpointError(f"the checkpoint of step {step} in {directory} has no committed shard")
    markers = [read_marker(directory, step, k) for k in keys]
    described = {(m.num_layers, m.tp_degree) for m in markers if m is not None and m.tp_degree is not None}
    if len(described) > 1:
        raise CheckpointError(f"the markers of step {step} in {directory} disagree on the model: {sorted(described)}")
    if described:
        num_layers, tp_degree = described.pop()
        assert num_layers is not None and tp_degree is not None
    else:  # version-1 markers: the shards present say it
        num_layers, tp_degree = max(k.layer for k in keys) + 1, max(k.tp_rank for k in keys) + 1
    have = set(keys)
    missing = [ShardKey(layer, t) for layer in range(num_layers) for t in range(tp_degree)
               if ShardKey(layer, t) not in have]
    if missing:
        named = ", ".join(shard_stem(k) for k in missing[:4]) + (" ..." if len(missing) > 4 else "")
        raise CheckpointError(f"the checkpoint of step {step} is incomplete: {len(missing)} shards were never "
                              f"committed ({named})")
    return num_layers, tp_degree


def check_shapes(directory: Path, step: int, cfg: GPTConfig) -> int:
    """The tensor-parallel degree of step `step`'s checkpoint after checking, from metadata
    alone, that its tensors are those of model `cfg` (CheckpointMismatch otherwise)."""
    num_layers, tp_degree = step_layout(directory, step)
    where = f"the checkpoint of step {step} in {directory}"
    if num_layers != cfg.num_layers:
        raise CheckpointMismatch(f"{where} is of another model shape: {num_layers} planning layers "
                                 f"({num_layers - 2} blocks); this model has {cfg.num_layers} ({cfg.n_layer} blocks)")
    for layer in range(num_layers):
        params = layer_parameters(cfg, layer)
        want = {f"{kind}/{n}" for n in params for kind in KINDS} | {"step"}
        for t in range(tp_degree):
            meta = shard_metadata(directory, step, ShardKey(layer, t))
            if set(meta) != want:
                odd = sorted(set(meta) ^ want)[:3]
                raise CheckpointMismatch(f"{where} is of another model: layer {layer} has other tensors ({odd})")
            for name, split in params.items():
                expected = split.shard_shape(tp_degree)
                got = meta[f"param/{name}"][0]
                if got != expected:
                    raise CheckpointMismatch(
                        f"{where} is of another model shape: {name} is {got} at tensor-parallel degree "
                        f"{tp_degree}, this model needs {expected} (full {split.full})")
    return tp_degree


def merge_layer(shards: dict[int, dict[str, torch.Tensor]], cfg: GPTConfig, layer: int) -> dict[str, torch.Tensor]:
    """The full canonical tensors (`param/<name>`, `exp_avg/<name>`, `exp_avg_sq/<name>`) and the
    AdamW `step` of one layer, from its shards at every tensor-parallel rank (tp_rank -> shard)."""
    degree = len(shards)
    if sorted(shards) != list(range(degree)):
        raise ValueError(f"layer {layer}: shards of tensor-parallel ranks {sorted(shards)}, not 0..{degree - 1}")
    steps = {int(s["step"]) for s in shards.values()}
    if len(steps) != 1:
        raise CheckpointError(f"layer {layer}: its shards disagree on the AdamW step count {sorted(steps)}")
    out = {"step": shards[0]["step"].clone()}
    for name, split in layer_parameters(cfg, layer).items():
        for kind in KINDS:
            full = split.merge([shards[t][f"{kind}/{name}"] for t in range(degree)])
            if tuple(full.shape) != split.full:
                raise CheckpointMismatch(f"layer {layer}: {kind}/{name} merges to {tuple(full.shape)}, "
                                         f"the model's is {split.full}")
            out[f"{kind}/{name}"] = full
    return out


def slice_layer(full: dict[str, torch.Tensor], cfg: GPTConfig, layer: int, *, rank: int, size: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s shard (of `size`) of one layer's full tensors (`merge_layer`'s output)."""
    out = {"step": full["step"].clone()}
    for name, split in layer_parameters(cfg, layer).items():
        for kind in KINDS:
            key = f"{kind}/{name}"
            out[key] = shard_tensor(full[key], split.tp_dim, rank, size,
                                    layout=split.layout).clone(memory_format=torch.contiguous_format)
    return out


def load_resharded(directory: Path, step: int, keys: list[ShardKey], *, cfg: GPTConfig, tp_degree: int) -> Shards:
    """The shards `keys` of a run at tensor-parallel degree `tp_degree`, from the checkpoint of
    `step` whatever degree wrote it (each file checked against its CRC-32 on the way)."""
    directory = Path(directory)
    if not step_dir(directory, step).is_dir():
        raise CheckpointError(f"no checkpoint of step {step} in {directory}")
    _, written = step_layout(directory, step)
    if written == tp_degree:
        return load_shards(directory, step, keys)
    out: Shards = {}
    for layer in sorted({k.layer for k in keys}):
        old = load_shards(directory, step, [ShardKey(layer, t) for t in range(written)])
        full = merge_layer({k.tp_rank: v for k, v in old.items()}, cfg, layer)
        del old
        for key in keys:
            if key.layer == layer:
                out[key] = slice_layer(full, cfg, layer, rank=key.tp_rank, size=tp_degree)
    return out
