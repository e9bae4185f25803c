"""The sharded optimizer (issue 55) trains the same model, bit for bit, as the unsharded one.

Real worker processes on gloo (the static launcher), tiny, 5 steps: each plan run with
`shard_optimizer="on"` and `"off"`; the losses and every final parameter must be equal, not
close. The plans shard for real: 4 one-stage pipelines at f = 1 (2 slices of every layer, 2
owners each), and at f = 0 two pipelines of two stages with tensor parallelism 2, and the
heterogeneous pair of pipelines whose holder sets differ from layer to layer (2 slices, one
owner each). The owned ranges themselves are checked against the plan's slices in-process.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest
import torch

from elastic.engine.optim_shards import gather_plan, layer_params, owned_ranges
from elastic.engine.shard_store import adopt
from elastic.model.config import get_preset
from elastic.model.gpt import GPTStage
from elastic.model.naming import layer_of
from elastic.parallel.layout import ParallelLayout, assign_ranks
from elastic.records.job import JobSpec
from elastic.records.summary import RunSummary, load_final_state
from elastic.roles.static_launcher import launch
from elastic.transfer.shards import ShardKey
from templates.optim_slices import aligned_cuts, plan_owners
from templates.plan import Plan, even_plan
from tests.engine.plans import TINY_LAYERS, hetero, two_by_two
from tests.engine.runs import OPTIM, STEPS

Result = tuple[RunSummary, dict[str, torch.Tensor]]


def _run(plan: Plan, run_dir: Path, mode: str) -> Result:
    spec = JobSpec(model="tiny", plan=plan, steps=STEPS, run_dir=str(run_dir), optim=OPTIM, device="cpu",
                   shard_optimizer=mode)
    return launch(spec, quiet=True, timeout_s=170), load_final_state(spec)


def _four_pipelines() -> Plan:
    return even_plan(num_layers=TINY_LAYERS, nodes=[0, 1, 2, 3], num_pipelines=4, global_microbatches=8,
                     microbatch_size=2, fault_tolerance=1)


PLANS = {
    "four-pipelines-f1": _four_pipelines,
    "two-by-two-tp2-f0": lambda: dataclasses.replace(two_by_two(), gpus_per_node=2, fault_tolerance=0),
    "hetero-f0": lambda: dataclasses.replace(hetero(), fault_tolerance=0),
}


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", sorted(PLANS))
def test_sharded_equals_unsharded_bit_for_bit(name: str, tmp_path: Path) -> None:
    plan = PLANS[name]()
    assert max(o.slices for o in plan_owners(plan).values()) == 2  # the plan does shard
    off, on = _run(plan, tmp_path / "off", "off"), _run(plan, tmp_path / "on", "on")
    assert on[0].steps_committed == off[0].steps_committed == STEPS
    assert on[0].losses == off[0].losses
    assert on[1].keys() == off[1].keys()
    for param, tensor in off[1].items():
        assert torch.equal(on[1][param], tensor), f"{param} differs between the sharded and unsharded runs"
    assert off[0].losses[-1] < off[0].losses[0] - 0.5  # it trained


@pytest.mark.parametrize("name", sorted(PLANS))
def test_owned_ranges_tile_each_layer_once_per_slice_and_the_gather_fills_the_rest(name: str) -> None:
    """Over the holders of a layer (at one tensor-parallel rank), the owned ranges cover each
    slice exactly by its owners, and what each holder receives is exactly what it does not own."""
    plan = PLANS[name]()
    cfg = get_preset("tiny")
    of = functools.partial(layer_of, cfg=cfg)
    with torch.device("meta"):
        whole = GPTStage(cfg)
    owners = plan_owners(plan)
    for w in assign_ranks(plan):
        if w.tp_rank:
            continue  # every rank of a node owns the same slice of its own shard
        layout = ParallelLayout(plan=plan, generation=0, node=w.node, local_rank=w.local_rank)
        held = set(layout.stage_plan.held)
        sizes = {n: p.numel() for n, p in whole.named_parameters() if of(n) in held}
        owned = owned_ranges(layout, sizes, of)
        received = {n: [0] * size for n, size in sizes.items()}
        for group in gather_plan(layout, sizes, of):
            for piece in group.pieces:
                if piece.kind == "recv":
                    for i in range(piece.start, piece.stop):
                        received[piece.name][i] += 1
        for layer, names in layer_params(sizes, of).items():
            j = owners[layer].slice_of(w.node)
            assert j is not None
            cuts = aligned_cuts([sizes[n] for n in names], owners[layer].slices)
            offset = 0
            for n in names:
                a, b = owned[n]
                mine = range(max(cuts[j], offset), min(cuts[j + 1], offset + sizes[n]))
                assert (a, b) == (mine.start - offset, mine.stop - offset) if len(mine) else a == b, n
                # every element I do not own arrives once when others hold the layer too, never mine
                alone = len(owners[layer].owners) == 1 and len(owners[layer].owners[0]) == 1
                assert received[n] == [0 if a <= i < b or alone else 1 for i in range(sizes[n])], n
                offset += sizes[n]


def test_a_fetched_slice_as_long_as_its_parameter_is_all_of_it() -> None:
    """A sharded holder's moments are flat: one that owns a whole 2-D parameter serves them as
    (n,), which the new holder takes as the whole state (found by the generated jobs, whose
    re-slicing saw a layer's coverage broken where only the biases had been kept); a shorter
    slice says not where it lies and is dropped."""
    skeleton = torch.nn.Parameter(torch.zeros(4, 32))
    whole = {"param/w": torch.randn(4, 32), "exp_avg/w": torch.randn(128), "exp_avg_sq/w": torch.rand(128),
             "step": torch.tensor(3)}
    param, state = adopt(ShardKey(0, 0), "w", skeleton, whole, torch.device("cpu"), sliced=True)
    assert state.span is None and state.step == 3
    assert torch.equal(state.exp_avg, whole["exp_avg/w"].view(4, 32))
    assert torch.equal(state.exp_avg_sq, whole["exp_avg_sq/w"].view(4, 32))
    part = {**whole, "exp_avg/w": torch.randn(64), "exp_avg_sq/w": torch.rand(64)}
    _, state = adopt(ShardKey(0, 0), "w", skeleton, part, torch.device("cpu"), sliced=True)
    assert state.span == (0, 0) and state.exp_avg.numel() == 0
    with pytest.raises(ValueError, match="shape"):
        adopt(ShardKey(0, 0), "w", skeleton, part, torch.device("cpu"), sliced=False)
