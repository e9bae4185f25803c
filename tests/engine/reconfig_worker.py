"""One worker process of the reconfiguration tests: the same process joins several generations.

`python -m tests.engine.reconfig_worker --scenario FILE --node N --local-rank L --store-port P`

The scenario (JSON) lists generations, each a plan and the step to train until. Between
generations every worker exports the shards it holds to files (atomically renamed), and a
worker of the next generation fetches its missing shards from those files: the test's
stand-in for the gRPC transfer. Optionally one worker SIGSTOPs itself mid-step (`stop`) and
the others abort that step from a timer thread (`abort_after_s`). Every worker writes
`result-<node>-<local_rank>.json`; TP rank 0 of each stage writes its full state at each step
of `save_at`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from elastic.engine.optim import OptimConfig
from elastic.engine.shard_store import ShardState
from elastic.engine.trainer import Trainer
from elastic.parallel.abort import AbortSignal, StepAborted
from elastic.records.job import JobSpec
from elastic.transfer.shards import ShardKey
from templates.plan import Plan

_FETCH_DEADLINE_S = 60.0


def shard_file(out: Path, generation: int, node: int, local_rank: int, key: ShardKey) -> Path:
    return out / f"gen{generation}" / f"node{node}-{local_rank}" / f"{key[0]}_{key[1]}.pt"


def export_all(trainer: Trainer, out: Path, generation: int, node: int, local_rank: int) -> None:
    for key in trainer.holdings():
        path = shard_file(out, generation, node, local_rank, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save(trainer.export_shard(*key), tmp)
        tmp.rename(path)


def file_fetch(out: Path, generation: int) -> Any:
    """A fetch function reading shards exported by generation `generation`'s workers."""

    def fetch(missing: list[ShardKey]) -> dict[ShardKey, ShardState]:
        got: dict[ShardKey, ShardState] = {}
        deadline = time.monotonic() + _FETCH_DEADLINE_S
        while len(got) < len(missing):
            for key in missing:
                if key in got:
                    continue
                found = sorted((out / f"gen{generation}").glob(f"*/{key[0]}_{key[1]}.pt"))
                if found:
                    got[key] = torch.load(found[0], weights_only=True)
            if time.monotonic() > deadline:
                raise TimeoutError(f"no holder exported {sorted(set(missing) - set(got))}")
            time.sleep(0.05)
        return got

    return fetch


def snapshot(trainer: Trainer) -> dict[str, torch.Tensor]:
    out = {f"param/{n}": p.detach().clone() for n, p in trainer.module.named_parameters()}
    for n, s in trainer.optimizer.state.items():
        out[f"exp_avg/{n}"] = s.exp_avg.clone()
        out[f"exp_avg_sq/{n}"] = s.exp_avg_sq.clone()
        out[f"step/{n}"] = torch.tensor(s.step)
    return out


def stop_self_at(trainer: Trainer, microbatch: int) -> None:
    """SIGSTOP this process in the forward of its `microbatch`-th microbatch of the next step."""
    calls = {"n": 0}

    def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        if calls["n"] == microbatch:
            os.kill(os.getpid(), signal.SIGSTOP)
        calls["n"] += 1

    trainer.module.register_forward_hook(hook)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scenario", required=True)
    parser.add_argument("--node", type=int, required=True)
    parser.add_argument("--local-rank", type=int, required=True)
    parser.add_argument("--store-port", type=int, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    scenario = json.loads(Path(args.scenario).read_text())
    out = Path(scenario["out"])
    plans = [Plan.from_dict(g["plan"]) for g in scenario["generations"]]
    spec = JobSpec(
        model="tiny",
        plan=plans[0],
        steps=scenario["generations"][-1]["until"],
        run_dir=str(out),
        optim=OptimConfig(**scenario["optim"]),
        device="cpu",
        collective_timeout_s=scenario.get("timeout_s", 60.0),
    )
    store = dist.TCPStore("127.0.0.1", args.store_port, is_master=False, timeout=timedelta(seconds=60))
    trainer = Trainer(spec, node=args.node, local_rank=args.local_rank)
    stop, abort_after = scenario.get("stop"), scenario.get("abort_after_s")
    result: dict[str, Any] = {"pid": os.getpid(), "generations": [], "losses": {}, "aborted": None}
    for g, plan in enumerate(plans):
        if args.node not in plan.nodes:
            break  # this worker leaves: the new generation does without it
        abort = AbortSignal()
        fetch = file_fetch(out, g - 1) if g > 0 else None
        timings = trainer.start(
            plan=plan, generation=g, store=store, abort=abort, fetch=fetch, step=trainer.step
        )
        result["generations"].append(
            {"generation": g, "pid": os.getpid(), "rank": trainer.layout.rank, "holdings": trainer.holdings(),
             "bytes_fetched": timings.bytes_fetched, "transfer_s": timings.transfer_s, "rebuild_s": timings.rebuild_s}
        )
        while trainer.step < scenario["generations"][g]["until"]:
            at_stop = stop is not None and trainer.step == stop["step"] and g == 0
            if at_stop and args.node == stop["node"]:
                stop_self_at(trainer, stop["microbatch"])
            before = snapshot(trainer) if at_stop else None
            set_at: list[float] = []
            if at_stop and abort_after is not None:

                def fire(a: AbortSignal = abort, times: list[float] = set_at) -> None:
                    times.append(time.perf_counter())
                    a.set("a peer stopped answering (test timer)")

                threading.Timer(abort_after, fire).start()
            try:
                prepared = trainer.prepare_step()
            except StepAborted as exc:
                left = time.perf_counter()
                after = snapshot(trainer)
                assert before is not None
                unchanged = before.keys() == after.keys() and all(
                    torch.equal(before[k], after[k]) for k in before
                )
                result["aborted"] = {
                    "step": trainer.step, "latency_s": left - set_at[0], "unchanged": unchanged,
                    "reason": str(exc), "grads_cleared": all(p.grad is None for p in trainer.module.parameters()),
                }
                break
            report = trainer.commit(prepared)
            result["losses"][str(report.step)] = report.loss
            if trainer.step in scenario["save_at"]:
                state = trainer.full_state()
                layout = trainer.layout
                if layout.tp_rank == 0:
                    path = out / "state" / f"step{trainer.step}" / f"p{layout.pipeline}-s{layout.stage}.pt"
                    path.parent.mkdir(parents=True, exist_ok=True)
                    torch.save(state, path)
        export_all(trainer, out, g, args.node, args.local_rank)
    result["final_step"] = trainer.step
    (out / f"result-{args.node}-{args.local_rank}.json").write_text(json.dumps(result))
    # Old generations' groups may hold abandoned operations (a stopped peer): their destructors
    # would wait for the group timeout at interpreter exit, so leave without running them.
    os._exit(0)


if __name__ == "__main__":
    main()
