"""The shards this worker holds, across generations: for every (layer, tensor-parallel rank) shard
its parameters and their AdamW state, exported by key (to peers over gRPC or the generation's
world group, to checkpoints) and adopted from a peer's export into a parameter of a new stage.

A held parameter is the very tensor the stage trains: a kept shard is handed to the next
generation's stage as the same object, with the same AdamW state object.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from torch import nn

from elastic.comm.device import host_copy, mark, settle
from elastic.engine.adamw import ParamState
from elastic.transfer.shards import ShardKey

ShardState = dict[str, torch.Tensor]
"""One shard's committed state: `param/<name>`, `exp_avg/<name>`, `exp_avg_sq/<name>` per
parameter of the layer (CPU tensors), and `step` (0-d int64: the AdamW step count)."""

FetchFn = Callable[[list[ShardKey]], dict[ShardKey, ShardState]]
"""Gets the state of shards this worker does not hold from their holders."""


HeldShard = dict[str, tuple[nn.Parameter, ParamState]]
"""One held shard: canonical name -> (parameter, its AdamW state)."""

Held = dict[ShardKey, HeldShard]
"""Every held shard by key."""


def shard_bytes(shards: dict[ShardKey, ShardState]) -> int:
    """Tensor bytes of `shards`."""
    return sum(t.numel() * t.element_size() for shard in shards.values() for t in shard.values())


def adopt(
    key: ShardKey, name: str, skeleton: nn.Parameter, shard: ShardState, device: torch.device,
    *, sliced: bool = False,
) -> tuple[nn.Parameter, ParamState]:
    """The parameter `name` and its AdamW state made from a fetched shard: its tensors are used
    as they are when they already have the device, dtype and layout (no copy), else copied.
    `sliced` (the sharded optimizer): flat moments are a sharded holder's slice; as many
    elements as the parameter are all of it, fewer say not where they lie: they are dropped
    (span (0, 0): of no elements)."""
    if "step" not in shard:
        raise ValueError(f"fetched shard {key} has no 'step' count")
    tensors = []
    for kind in ("param", "exp_avg", "exp_avg_sq"):
        src = shard.get(f"{kind}/{name}")
        if src is None:
            raise ValueError(f"fetched shard {key} lacks {kind}/{name}")
        if kind != "param" and sliced and tuple(src.shape) != tuple(skeleton.shape) and src.dim() == 1:
            # a slice as long as the parameter is all of it; a shorter one says not where it lies
            src = src.view(skeleton.shape) if src.numel() == skeleton.numel() else src.new_zeros(0)
        elif tuple(src.shape) != tuple(skeleton.shape):
            raise ValueError(
                f"fetched shard {key}: {kind}/{name} has shape {tuple(src.shape)}, expected {tuple(skeleton.shape)}"
            )
        if src.device != device or src.dtype != skeleton.dtype or not src.is_contiguous():
            src = src.to(device=device, dtype=skeleton.dtype).contiguous()
        tensors.append(src.detach())
    param = nn.Parameter(tensors[0])
    param.__dict__.update(skeleton.__dict__)  # tensor-parallel attributes (tp_dim, full_shape)
    span = (0, 0) if tensors[1].numel() != tensors[0].numel() else None
    return param, ParamState(exp_avg=tensors[1], exp_avg_sq=tensors[2], step=int(shard["step"]), span=span)


def export_held(key: ShardKey, entries: HeldShard, *, copy: bool) -> ShardState:
    """One shard's tensors by name: host copies (`copy`: on CUDA through pinned memory, waited
    for here), or the held tensors themselves (with the step count on their device)."""
    out: ShardState = {}
    steps = set()
    for name, (param, state) in entries.items():
        for kind, t in (("param", param.detach()), ("exp_avg", state.exp_avg), ("exp_avg_sq", state.exp_avg_sq)):
            out[f"{kind}/{name}"] = host_copy(t) if copy else t
        steps.add(state.step)
    assert len(steps) == 1, f"shard {key}: parameters disagree on the AdamW step count {steps}"
    held = next(iter(entries.values()))[0].device
    if copy:
        settle(mark(held))
    out["step"] = torch.tensor(steps.pop(), dtype=torch.int64, device=torch.device("cpu") if copy else held)
    return out


class ShardStore:
    """The shards this worker serves: those of its current stage, and until the next switch the
    ones the last switch dropped (still at that switch's committed state), so slower peers of
    the same reconfiguration can fetch them from this worker."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        """Guards what `export` serves against the optimizer update and the switch: whoever
        changes the held tensors or replaces them holds it."""
        self._served: Held = {}
        self._retired: Held = {}

    def held(self) -> Held:
        """The shards of the current stage (a copy of the map; the tensors are the held ones)."""
        with self.lock:
            return dict(self._served)

    def keys(self) -> list[ShardKey]:
        """The shards of the current stage, ascending."""
        with self.lock:
            return sorted(self._served)

    def replace(self, served: Held) -> None:
        """Serve `served` from now on; the shards it drops stay servable (retired) until the next
        call. The caller holds `lock`."""
        self._retired = {k: v for k, v in self._served.items() if k not in served}
        self._served = served

    def export(self, key: ShardKey, *, copy: bool) -> ShardState:
        """The committed state of one served or retired shard (KeyError if neither); `copy`: as
        host copies, else the held tensors themselves (`export_held`)."""
        with self.lock:
            entries = self._served.get(key, self._retired.get(key))
            if entries is None:
                raise KeyError(f"shard (layer {key.layer}, tp_rank {key.tp_rank}) is not held by this worker")
            return export_held(key, entries, copy=copy)
