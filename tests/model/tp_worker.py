"""Worker for the tensor-parallel equivalence tests: runs in a spawned process."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from elastic.comm import Communicator
from elastic.data import TokenDataset
from elastic.model import GPTStage, TensorParallel, get_preset
from elastic.model.init import name_seed, shard_tensor
from elastic.model.state import full_state_dict, gather_full

BATCH = 4
DROPOUT_KEY = 7


def tp_from_group(group: dist.ProcessGroup) -> TensorParallel:
    """The tensor-parallel context of the calling process inside the gloo process group `group`."""
    size = group.size()
    comm = Communicator(group, name="tp", members=range(size), backend="gloo", device=torch.device("cpu"))
    return TensorParallel(group=comm, rank=group.rank(), size=size)


def full_grad_dict(module: nn.Module, tp: TensorParallel) -> dict[str, torch.Tensor]:
    """Canonical name -> full fp32 CPU gradient of every parameter that has one."""
    out = {}
    for name, p in module.named_parameters():
        if p.grad is not None:
            out[name] = gather_full(p.grad, p.tp_dim, tp, layout=p.tp_layout).float().cpu()  # type: ignore[attr-defined]
    return out


def load_full_state(module: nn.Module, state: dict[str, torch.Tensor], tp: TensorParallel) -> None:
    """Copy this rank's shard of each full tensor in `state` into `module`'s parameters."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name not in state:
                raise KeyError(f"state has no tensor for parameter {name!r}")
            full = state[name]
            if tuple(full.shape) != tuple(p.full_shape):  # type: ignore[attr-defined]
                raise ValueError(f"{name}: state shape {tuple(full.shape)} != model shape {p.full_shape}")  # type: ignore[attr-defined]
            p.copy_(shard_tensor(full, p.tp_dim, tp.rank, tp.size, layout=p.tp_layout))  # type: ignore[attr-defined]


def perturbation(name: str, shape: torch.Size) -> torch.Tensor:
    generator = torch.Generator().manual_seed(name_seed(99, name))
    return 0.05 * torch.randn(shape, generator=generator)


def run_case(cfg_overrides: dict[str, float], tp: TensorParallel, split: int | None) -> dict[str, object]:
    """Loss, full gradients and full initial parameters of one forward/backward."""
    cfg = get_preset("tiny").with_overrides(**cfg_overrides)
    inputs, targets = TokenDataset(seq_len=cfg.seq_len).batch(range(BATCH))
    stages = [GPTStage(cfg, tp=tp)] if split is None else [GPTStage(cfg, last=split, tp=tp), GPTStage(cfg, first=split, tp=tp)]
    initial: dict[str, torch.Tensor] = {}
    for stage in stages:
        stage.train()
        initial.update(full_state_dict(stage, tp))
        # Move every parameter off its initial value (biases 0, LayerNorm 1) so that a bias
        # added twice or a LayerNorm gradient summed wrongly cannot hide; same on every layout.
        load_full_state(stage, {name: full + perturbation(name, full.shape) for name, full in full_state_dict(stage, tp).items()}, tp)
    x = inputs
    for stage in stages:
        x = stage(x, dropout_key=DROPOUT_KEY)
    loss = stages[-1].loss(x, targets)
    loss.backward()
    grads: dict[str, torch.Tensor] = {}
    for stage in stages:
        grads.update(full_grad_dict(stage, tp))
    return {"loss": loss.detach(), "grads": grads, "params": initial}


def main(rank: int, world: int, init_file: str, out_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        tp = tp_from_group(dist.group.WORLD)  # type: ignore[arg-type]
        results = {
            "plain": run_case({}, tp, None),
            "dropout": run_case({"dropout": 0.1}, tp, None),
            "two_stages": run_case({}, tp, 3),
        }
        torch.save(results, f"{out_file}.{rank}")
    finally:
        dist.destroy_process_group()
