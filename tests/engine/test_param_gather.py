"""The sharded optimizer's gather waited layer by layer (elastic/engine/param_gather.py): each
layer's group is waited for right before that layer's first forward, so the transfer of a later
layer overlaps the forward of an earlier one, and the wait is taken out of the forward's time.
Real gloo groups, a real GPT stage."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable

import pytest
import torch

from elastic.comm import P2P, Handle
from elastic.engine.optim_shards import PendingGather
from elastic.engine.param_gather import layer_modules, waited_on_first_use
from elastic.model.config import get_preset
from elastic.model.gpt import GPTStage
from elastic.model.naming import layer_of
from elastic.parallel.phase_clock import PhaseClock
from tests.comm.support import gloo_comms

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("model", ["tiny", "llama-tiny"])
def test_every_parameter_lies_in_one_layers_module(model: str) -> None:
    cfg = get_preset(model)
    of = functools.partial(layer_of, cfg=cfg)
    for first, last in [(0, cfg.num_layers), (0, 2), (2, cfg.num_layers - 1), (cfg.num_layers - 1, cfg.num_layers)]:
        with torch.device("meta"):
            stage = GPTStage(cfg, first=first, last=last)
        modules = layer_modules(stage, of)
        assert sorted(modules) == list(range(first, last))
        names = {id(p): n for n, p in stage.named_parameters()}
        for layer, subs in modules.items():
            for sub in subs:
                assert {of(names[id(p)]) for p in sub.parameters()} == {layer}
        assert sum(len(list(sub.parameters())) for subs in modules.values() for sub in subs) == len(names)


@pytest.mark.parametrize("model", ["tiny", "llama-tiny"])
def test_every_hooked_module_runs_in_a_forward(model: str) -> None:
    """A hook on a module the forward never calls (a container such as `blocks`) would never
    wait: that layer's forward would read parameters still being received. Every stage range
    and an interleaved stage's chunks, each chunk run once, for real."""
    cfg = get_preset(model)
    of = functools.partial(layer_of, cfg=cfg)
    n = cfg.num_layers
    stages = [((lo, hi),) for lo in range(n) for hi in range(lo + 1, n + 1)]
    stages += [((0, 2), (3, 5)), ((1, 3), (4, n)), ((2, 3), (5, n))]
    for ranges in stages:
        torch.manual_seed(0)
        stage = GPTStage(cfg, chunks=ranges)
        modules = layer_modules(stage, of)
        assert sorted(modules) == sorted(layer for lo, hi in ranges for layer in range(lo, hi))
        hooked = [sub for subs in modules.values() for sub in subs]
        ran: set[int] = set()
        for sub in hooked:
            sub.register_forward_pre_hook(functools.partial(_note, ran))
        with torch.no_grad():
            for chunk, (lo, _) in enumerate(ranges):
                x = (torch.zeros(1, cfg.seq_len, dtype=torch.long) if lo == 0
                     else torch.zeros(1, cfg.seq_len, cfg.d_model))
                stage(x, dropout_key=0, chunk=chunk)
        assert ran == {id(sub) for sub in hooked}, ranges


def _note(ran: set[int], module: torch.nn.Module, _args: object) -> None:
    ran.add(id(module))


def test_each_layer_waits_for_its_gather_right_before_its_first_forward() -> None:
    """The peer sends layer l's piece only once layer l - 1's forward ran: a gather waited for
    whole before the forward would never get it (gloo's timeout ends that wait)."""
    cfg = get_preset("tiny")
    stage = GPTStage(cfg)
    modules = layer_modules(stage, functools.partial(layer_of, cfg=cfg))
    layers = sorted(modules)
    a, b = gloo_comms(2, timeout_s=10)
    ran = {layer: threading.Event() for layer in layers}
    events: list[tuple[str, int]] = []

    def forwarded(layer: int) -> Callable[..., None]:
        def hook(*_: object) -> None:
            events.append(("forward", layer))
            ran[layer].set()
        return hook

    for layer in layers:
        for sub in modules[layer]:
            sub.register_forward_hook(forwarded(layer))
    got = {layer: torch.zeros(4) for layer in layers}
    handles = {layer: a.post([P2P("recv", got[layer], 1, tag=layer)]) for layer in layers}
    layer_of_handle = {id(h): layer for layer, h in handles.items()}

    def send() -> None:
        for layer in layers:
            if layer > 0 and not ran[layer - 1].wait(10):
                return
            b.post([P2P("send", torch.full((4,), float(layer)), 0, tag=layer)]).wait()

    def wait(handle: Handle) -> None:
        events.append(("wait", layer_of_handle[id(handle)]))
        handle.wait()

    sender = threading.Thread(target=send)
    sender.start()
    pending = PendingGather(handles={layer: [h] for layer, h in handles.items()}, sent=0)
    with waited_on_first_use(pending, modules, wait=wait, clock=None):
        stage(torch.zeros(1, cfg.seq_len, dtype=torch.long), dropout_key=0)
    sender.join()
    assert events == [(kind, layer) for layer in layers for kind in ("wait", "forward")]
    assert not pending.handles
    assert all(torch.equal(got[layer], torch.full((4,), float(layer))) for layer in layers)


def test_a_wait_inside_a_forward_is_not_the_forwards_time() -> None:
    clock = PhaseClock(torch.device("cpu"))
    with clock.timed("forward"), clock.excluded("forward"):
        time.sleep(0.4)
    assert clock.totals().forward < 0.1
    with clock.timed("forward"):
        time.sleep(0.4)
    assert clock.totals().forward >= 0.35
