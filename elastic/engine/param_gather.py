"""The sharded optimizer's parameter gather, overlapped with the step's first forward (issue 55).

A sharded step begins with the parameters outside this worker's slices one update behind
(elastic/engine/optim_shards.py). The step posts the whole gather before its schedule (one group
a layer, ascending, from the training thread, on the world communicator: the same place and
order as a gather waited for at once) and waits for a layer's group only right before that
layer's first forward: a forward pre-hook on each layer's module. Layer l + 1's transfer then
runs while layer l computes, as Megatron's distributed optimizer overlaps its parameter
all-gather with the forward, bucket by bucket. A group no forward waited for (a schedule with
no microbatch here) is waited for when the schedule returns, so the step's commit and
everything after it see the gathered parameters. A wait's seconds count as the step's `wait`
phase and are taken out of the forward that held it (`PhaseClock.excluded`): the straggler
detector sees a node's own compute, not its peers' lateness.

An error in the schedule leaves the groups not yet waited for pending, and the worker `behind`:
a step that does not commit ends its generation (elastic/roles/elastic_worker.py), and the next
generation's first step gathers again over its own groups (the gather is idempotent).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from elastic.comm import Handle
from elastic.engine.optim_shards import PendingGather
from elastic.parallel.phase_clock import PhaseClock


def layer_modules(module: torch.nn.Module, layer_of: Callable[[str], int]) -> dict[int, list[torch.nn.Module]]:
    """Layer -> the outermost submodules of `module` whose parameters all belong to that layer
    (a GPT stage's embedding, blocks and head); every parameter lies in one of them. Containers
    (`ModuleDict`, `ModuleList`) are never called, so their hooks would never run: a stage's
    only block is hooked itself, not the `blocks` that holds it."""
    out: dict[int, list[torch.nn.Module]] = {}
    taken: list[str] = []
    for prefix, sub in module.named_modules():
        if (not prefix or isinstance(sub, (torch.nn.ModuleDict, torch.nn.ModuleList))
                or any(prefix.startswith(t + ".") for t in taken)):
            continue
        layers = {layer_of(f"{prefix}.{name}") for name, _ in sub.named_parameters()}
        if len(layers) == 1:
            out.setdefault(layers.pop(), []).append(sub)
            taken.append(prefix)
    covered = {id(p) for subs in out.values() for sub in subs for p in sub.parameters()}
    loose = [name for name, p in module.named_parameters() if id(p) not in covered]
    if loose:
        raise ValueError(f"parameters {loose} lie in no submodule of a single layer: the gather cannot wait for them")
    return out


@contextmanager
def waited_on_first_use(
    pending: PendingGather | None, modules: dict[int, list[torch.nn.Module]], *, wait: Callable[[Handle], None],
    clock: PhaseClock | None,
) -> Iterator[None]:
    """While open, a layer's first forward waits for its pending group (with `wait`, out of
    `clock`'s forward); at a normal exit every group is waited for. Nothing pending: nothing."""
    if pending is None:
        yield
        return

    def hook_for(layer: int) -> Callable[[torch.nn.Module, object], None]:
        def hook(_module: torch.nn.Module, _args: object) -> None:
            if layer in pending.handles:
                if clock is None:
                    pending.wait_layer(layer, wait)
                else:
                    with clock.excluded("forward"):
                        pending.wait_layer(layer, wait)
        return hook

    hooks = [sub.register_forward_pre_hook(hook_for(layer)) for layer, subs in modules.items() for sub in subs]
    try:
        yield
    finally:
        for handle in hooks:
            handle.remove()
    pending.wait_all(wait)
