"""Planner speed: templates for every pipeline size up to 64 nodes of a GPT-3 175B-shaped model,
then the fastest instantiation for every cluster size N in [64, 256] with f = 3.

The baseline is the same exact search without its bottleneck window: every possible stage
time is tried as the bound (what a plain "enumerate the bottleneck, min-sum DP per value"
search does). Both must return the same iteration times; the ratio is baseline / windowed.

    .venv/bin/python bench/planner_bench.py [--no-baseline] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastic.model.config import GPTConfig  # noqa: E402
from elastic.planning.cluster import gpt_layer_counts  # noqa: E402
from templates.cost import StageCosts  # noqa: E402
from templates.derive import DeviceSpeed, derive_profile  # noqa: E402
from templates.instantiation import instantiate  # noqa: E402
from templates.search import _minsum_dp, search_templates  # noqa: E402
from templates.template_set import TemplateSet  # noqa: E402

# GPT-3 175B (Brown et al. 2020): 96 blocks, d_model 12288, 96 heads, 2048 tokens.
GPT3_175B = GPTConfig(vocab_size=50304, seq_len=2048, n_layer=96, n_head=96, d_model=12288)
GPUS_PER_NODE = 8
MAX_TEMPLATE_NODES = 64
FAULT_TOLERANCE = 3
GLOBAL_MICROBATCHES = 1536  # GPT-3's batch of 1536 sequences, microbatch 1


def unwindowed_best(costs: StageCosts, shares: dict[int, int]) -> dict[int, float]:
    """Baseline: min over EVERY candidate bound B of minsum(B) + (m - 1) B, for each n."""
    k_max = max(shares)
    cost_k = [np.empty(0)] + [costs.costs(k) for k in range(1, k_max + 1)]
    best = {n: np.inf for n in shares}
    candidates = costs.candidate_times()
    for start in range(0, len(candidates), 32):
        batch = candidates[start : start + 32]
        sums = _minsum_dp(cost_k, k_max, batch)
        for n, m in shares.items():
            best[n] = min(best[n], float(np.min(sums[n] + (m - 1) * batch)))
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-baseline", action="store_true", help="skip the (slow) unwindowed baseline")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()

    device = DeviceSpeed(flops_per_second=150e12, memory_bytes=80 * 2**30, description="A100-80GB-like")
    profile = derive_profile(
        model="gpt3-175b", layers=gpt_layer_counts(GPT3_175B), seq_len=GPT3_175B.seq_len, microbatch_size=1,
        device=device,
    )
    costs = StageCosts(profile, GPUS_PER_NODE)
    shares = {n: max(1, round(GLOBAL_MICROBATCHES * n / 256)) for n in range(1, MAX_TEMPLATE_NODES + 1)}

    t0 = time.perf_counter()
    templates = search_templates(costs, shares)
    template_s = time.perf_counter() - t0
    n0 = min(templates)
    tset = TemplateSet(
        profile=profile, gpus_per_node=GPUS_PER_NODE, min_nodes=n0, max_nodes=MAX_TEMPLATE_NODES, templates=templates
    )

    t0 = time.perf_counter()
    plans = {
        n: instantiate(tset, list(range(n)), global_microbatches=GLOBAL_MICROBATCHES, fault_tolerance=FAULT_TOLERANCE)
        for n in range(64, 257)
    }
    instantiate_s = time.perf_counter() - t0

    result: dict[str, object] = {
        "layers": profile.num_layers,
        "templates": len(templates),
        "template_sizes": [n0, max(templates)],
        "template_seconds": round(template_s, 4),
        "instantiations": len(plans),
        "instantiate_seconds": round(instantiate_s, 4),
        "instantiate_ms_per_N": round(1000 * instantiate_s / len(plans), 2),
        "iteration_time_N64": round(plans[64].iteration_time, 4),
        "iteration_time_N256": round(plans[256].iteration_time, 4),
        "pipelines_N256": len(plans[256].pipelines),
    }
    if not args.no_baseline:
        t0 = time.perf_counter()
        reference = unwindowed_best(costs, {n: shares[n] for n in templates})
        baseline_s = time.perf_counter() - t0
        worst = max(abs(templates[n].iteration_time - reference[n]) / reference[n] for n in templates)
        result.update(
            baseline_seconds=round(baseline_s, 4),
            speedup_vs_baseline=round(baseline_s / template_s, 2),
            max_rel_difference=worst,
        )
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>24}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
