"""Elastic worker: `python -m elastic.runtime.elastic_worker --etcd HOST:PORT --job J --node N ...`.

One process per (node, device), started by its node's agent and alive for the whole job. Its
loop, per step s of generation g: prepare (forward, backward, gradient reductions) -> write
`steps/<g>/<s>/ready/<rank>` -> wait for the leader's decision -> commit or discard. A watcher
on generations sets the generation's AbortSignal when g+1 appears, which frees a step blocked
on a dead or stopped peer. At the boundary the worker moves to the newest generation that
includes it: it lets its ShardServer serve that generation (its committed state), then
`Trainer.start` keeps the shards it holds, fetches the missing ones from live holders (or
from the checkpoint the leader names) and builds the new groups; training replays from the
generation's `resume_step`. A worker whose node was drained (`elastic drain`: a generation
without it, naming it in `drained`) serves its committed shards to the survivors until a newer
generation has committed a step, then reports itself done and exits 0. The job token comes in
the ELASTIC_JOB_TOKEN environment variable.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from elastic.coordinator.access import JobAccessError, admit
from elastic.coordinator.client import EtcdConfig, connect
from elastic.coordinator.generations import Generation, Generations
from elastic.coordinator.keys import JobKeys
from elastic.coordinator.monitor import die_with_parent
from elastic.coordinator.store import EtcdStore
from elastic.coordinator.watch import PrefixWatch, WatchEvent
from elastic.parallel.abort import AbortSignal
from elastic.parallel.layout import ParallelLayout
from elastic.runtime.netaddr import bind_host
from elastic.runtime.protocol import (
    ABORT,
    COMMIT,
    ElasticConfig,
    GenerationRecord,
    RecoveryTimings,
    RunKeys,
    StepResult,
    WorkerInfo,
)
from elastic.runtime.trainer import Trainer
from elastic.transfer.client import FetchConfig, TransferError, fetch_shards, list_shards
from elastic.transfer.server import ServerConfig, ShardServer

TOKEN_ENV = "ELASTIC_JOB_TOKEN"
_LIST_RETRY_S = 0.02
_STORE_SLICE_S = 0.2


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class AbortableStore(EtcdStore):
    """The generation's etcd Store, whose blocking waits end as soon as the generation is
    aborted: a rendezvous with a peer that died during the reconfiguration does not wait out
    the store timeout."""

    def __init__(self, client: Any, prefix: str, *, timeout: timedelta, abort: AbortSignal) -> None:
        super().__init__(client, prefix, timeout=timeout)
        self._abort = abort

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        deadline = time.monotonic() + (timeout if timeout is not None else self.timeout).total_seconds()
        while True:
            if self._abort.is_set():
                raise dist.DistStoreError(f"rendezvous abandoned: {self._abort.reason}")
            remaining = max(0.0, deadline - time.monotonic())
            try:
                super().wait(keys, timedelta(seconds=min(_STORE_SLICE_S, remaining)))
                return
            except dist.DistStoreError:
                if time.monotonic() >= deadline:
                    raise


class GenerationFeed:
    """The job's generation records as they are published; sets the current abort on a newer one."""

    def __init__(self, generations: Generations) -> None:
        self._records: dict[int, tuple[GenerationRecord, float]] = {}
        self._cond = threading.Condition()
        self._abort: AbortSignal | None = None
        self._current = 0
        self._watch = generations.watch(self._on_generation, after=0)

    def _on_generation(self, gen: Generation) -> None:
        record = GenerationRecord.from_json(gen.plan)
        with self._cond:
            self._records[gen.number] = (record, time.time())
            if gen.number > self._current and self._abort is not None:
                self._abort.set(f"generation {gen.number} published: {record.reason}")
            self._cond.notify_all()

    def enter(self, number: int, abort: AbortSignal) -> None:
        """Make `number` the current generation, with `abort` set when a newer one appears."""
        with self._cond:
            self._current, self._abort = number, abort
            if self.latest() > number:
                abort.set("a newer generation was already published")

    def latest(self) -> int:
        with self._cond:
            return max(self._records, default=0)

    def get(self, number: int) -> tuple[GenerationRecord, float]:
        with self._cond:
            return self._records[number]

    def wait_newer(self, than: int, timeout: float) -> int:
        """The newest generation number above `than`; TimeoutError after `timeout` s."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.latest() > than, timeout):
                raise TimeoutError(f"no generation after {than} within {timeout:.0f} s")
            return self.latest()

    def close(self) -> None:
        self._watch.cancel()


class Drained(Exception):
    """This worker's node was drained out of the job by generation `generation`."""

    def __init__(self, generation: int) -> None:
        super().__init__(f"drained by generation {generation}")
        self.generation = generation


class DecisionFeed:
    """The leader's commit/abort decisions, (generation, step) -> decision."""

    def __init__(self, client: Any, keys: RunKeys) -> None:
        self._decisions: dict[tuple[int, int], str] = {}
        self._cond = threading.Condition()
        self._prefix = keys.steps
        resp = client.get_prefix_response(keys.steps)
        for kv in resp.kvs:
            self._add(kv.key.decode(), kv.value.decode())
        self._watch = PrefixWatch(
            client, keys.steps, self._on_events, start_revision=int(resp.header.revision) + 1
        )

    def _add(self, key: str, value: str) -> None:
        parts = key[len(self._prefix) :].split("/")
        if len(parts) == 3 and parts[2] == "decision":
            self._decisions[(int(parts[0]), int(parts[1]))] = value

    def _on_events(self, events: list[WatchEvent]) -> None:
        with self._cond:
            for ev in events:
                if ev.kind == "put":
                    self._add(ev.key, ev.value.decode())
            self._cond.notify_all()

    def wait(self, generation: int, step: int, timeout: float) -> str:
        with self._cond:
            if not self._cond.wait_for(lambda: (generation, step) in self._decisions, timeout):
                raise TimeoutError(
                    f"no decision for step {step} of generation {generation} in {timeout:.0f} s"
                )
            return self._decisions[(generation, step)]

    def committed_since(self, generation: int) -> bool:
        """Whether some generation >= `generation` has committed a step."""
        with self._cond:
            return any(g >= generation and d == COMMIT for (g, _), d in self._decisions.items())

    def close(self) -> None:
        self._watch.cancel()


class ElasticWorker:
    """The worker loop of the module doc."""

    def __init__(self, *, client: Any, keys: JobKeys, config: ElasticConfig, token: str,
                 node: int, local_rank: int, incarnation: int, lease: int) -> None:  # fmt: skip
        self.client, self.keys, self.rk = client, keys, RunKeys(keys)
        self.config, self.spec, self.token = config, config.spec, token
        self.node, self.local_rank, self.incarnation = node, local_rank, incarnation
        torch.set_num_threads(self.spec.threads_per_worker)
        self.trainer = Trainer(self.spec, node=node, local_rank=local_rank)
        self.server = ShardServer(
            ServerConfig(token=token, host=bind_host()),
            provider=lambda layer, tp: self.trainer.export_shard(layer, tp),
            holdings=lambda: self.trainer.holdings(),
        ).start()
        info = WorkerInfo(pid=os.getpid(), transfer_address=self.server.address, incarnation=incarnation)
        client.put(self.rk.worker(node, local_rank), info.to_json(), lease=lease)
        self.lease = lease
        self.generations = GenerationFeed(Generations(client, keys))
        self.decisions = DecisionFeed(client, self.rk)
        self.timeout = self.spec.collective_timeout_s
        self.writer: Any = None
        if config.checkpoint_every > 0:
            from elastic.runtime.checkpoint import CheckpointWriter

            cfg = self.spec.model_config
            self.writer = CheckpointWriter(
                Path(config.checkpoint_path),
                num_layers=cfg.num_layers,
                tp_degree=self.spec.plan.gpus_per_node,
            )

    # ---- the loop ------------------------------------------------------------------------

    def run(self) -> None:
        try:
            layout = self._run_generations()
        except Drained as drained:
            self._leave_drained(drained.generation)
            return
        self._finish(layout)

    def _run_generations(self) -> ParallelLayout:
        """Train through every generation that includes this node; the last one's layout."""
        generation = self._next_generation(0)
        while True:
            try:
                layout = self._reconfigure(generation)
            except Exception as exc:  # aborted by g+1, or a peer died while groups were built
                _log(f"reconfiguration into generation {generation} failed: {type(exc).__name__}: {exc}")
                generation = self._next_generation(generation)
                continue
            if self._train(generation, layout):
                return layout
            generation = self._next_generation(generation)

    def _leave_drained(self, generation: int) -> None:
        """Serve this worker's committed shards until the survivors have them, then report done."""
        _log(f"drained by generation {generation}: serving shards until it commits a step")
        deadline = time.monotonic() + self.timeout * 4
        while not self.decisions.committed_since(generation):
            latest = self.generations.latest()
            if latest > self.server.generation:  # a failure during the drain: serve the newer one
                self.server.set_generation(latest)
            if time.monotonic() > deadline:
                _log(f"generation {generation} committed nothing in {self.timeout * 4:.0f} s; leaving anyway")
                break
            time.sleep(0.05)
        if self.writer is not None:
            self.writer.flush()
        self.client.put(self.rk.worker_done(self.node, self.local_rank), "drained")

    def _next_generation(self, after: int) -> int:
        """The newest generation after `after` that includes this node's incarnation."""
        while True:
            number = self.generations.wait_newer(after, self.timeout * 4)
            record, _ = self.generations.get(number)
            if record.incarnations.get(self.node) == self.incarnation:
                return number
            if self.node in record.drained and self.node not in record.incarnations:
                self.server.set_generation(number)  # survivors fetch from us under this generation
                raise Drained(number)
            if after > 0 and self.node not in record.incarnations:
                raise RuntimeError(f"node {self.node} is not part of generation {number}: leaving the job")
            after = number

    def _reconfigure(self, generation: int) -> ParallelLayout:
        record, seen_at = self.generations.get(generation)
        layout = ParallelLayout(
            plan=record.plan, generation=generation, node=self.node, local_rank=self.local_rank
        )
        abort = AbortSignal()
        self.generations.enter(generation, abort)
        # Every in-flight step of the old generation is resolved: serve the committed state of `generation`.
        self.server.set_generation(generation)
        fetch: Callable[[list[tuple[int, int]]], dict[tuple[int, int], dict[str, torch.Tensor]]] | None
        if record.restore_checkpoint is not None:
            from elastic.runtime.checkpoint import load_shards

            if self.trainer.holdings():  # restart from the checkpoint: drop the newer state held here
                self.trainer = Trainer(self.spec, node=self.node, local_rank=self.local_rank)
            ckpt, directory = record.restore_checkpoint, Path(self.config.checkpoint_path)
            _log(f"generation {generation}: restoring from the checkpoint of step {ckpt} in {directory}")

            def fetch(missing: list[tuple[int, int]]) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
                return load_shards(directory, ckpt, missing)

        elif generation == 1 or not self._held_before(generation):
            fetch = None if generation == 1 else self._fetch_from_holders(generation, record)
        else:
            fetch = self._fetch_from_holders(generation, record)
        timings = self.trainer.start(
            plan=record.plan,
            generation=generation,
            store=AbortableStore(
                self.client,
                self.keys.store(f"gen-{generation}"),
                timeout=timedelta(seconds=self.timeout),
                abort=abort,
            ),  # fmt: skip
            abort=abort,
            fetch=fetch,
            step=record.resume_step if record.restore_checkpoint is None else record.restore_checkpoint,
        )
        self._pending_recovery = (seen_at, timings, time.time())
        held = json.dumps(sorted(self.trainer.holdings()))
        self.client.put(self.rk.worker_holdings(self.node, self.local_rank), held, lease=self.lease)
        _log(
            f"generation {generation}: rank {layout.rank} pipeline {layout.pipeline} stage {layout.stage} "
            f"layers {layout.layers}, transfer {timings.transfer_s:.3f} s ({timings.bytes_fetched} B), "
            f"groups {timings.rebuild_s:.3f} s, resuming at step {self.trainer.step}"
        )
        return layout

    def _held_before(self, generation: int) -> bool:
        return generation > 1 and bool(self.trainer.holdings())

    def _fetch_from_holders(
        self, generation: int, record: GenerationRecord
    ) -> Callable[[list[tuple[int, int]]], dict[tuple[int, int], dict[str, torch.Tensor]]]:
        config = FetchConfig(token=self.token, generation=generation, stall_timeout_s=min(30.0, self.timeout))

        def fetch(missing: list[tuple[int, int]]) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
            holders = self._holders(generation, record, config)
            result = fetch_shards(missing, holders, config)
            return dict(result.shards)

        return fetch

    def _holders(
        self, generation: int, record: GenerationRecord, config: FetchConfig
    ) -> dict[str, list[tuple[int, int]]]:
        """address -> shards, asked of every live worker of the generation (they wait until resolved)."""
        holders: dict[str, list[tuple[int, int]]] = {}
        for value, _meta in self.client.get_prefix(self.rk.workers):
            info = WorkerInfo.from_json(value)
            if info.transfer_address == self.server.address:
                continue
            deadline = time.monotonic() + self.timeout
            while True:
                try:
                    held = list_shards(info.transfer_address, config, timeout_s=5.0)
                    break
                except TransferError as exc:
                    if "UNAVAILABLE" in str(exc) and "generation" in str(exc) and time.monotonic() < deadline:
                        time.sleep(_LIST_RETRY_S)
                        continue
                    _log(f"holder {info.transfer_address} (pid {info.pid}) skipped: {exc}")
                    held = None
                    break
            if held is not None and held.shards:
                holders[info.transfer_address] = [tuple(k) for k in held.shards]  # type: ignore[misc]
        return holders

    def _train(self, generation: int, layout: ParallelLayout) -> bool:
        """Run steps of `generation`; True when the job's steps are all committed."""
        first_commit = True
        while self.trainer.step < self.spec.steps:
            step = self.trainer.step
            if self.generations.latest() > generation:
                return False
            start, started_at = time.perf_counter(), time.time()
            try:
                prepared = self.trainer.prepare_step()
            except Exception as exc:  # StepAborted, StepDiscarded, or a peer's death seen by gloo
                _log(f"step {step} of generation {generation} not prepared: {type(exc).__name__}: {exc}")
                decision = self.decisions.wait(generation, step, self.timeout * 2)
                assert decision == ABORT, "a step some worker did not prepare cannot commit"
                self.generations.wait_newer(generation, self.timeout * 2)
                return False
            self.client.put(self.rk.ready(generation, step, layout.rank), str(started_at))
            decision = self.decisions.wait(generation, step, self.timeout * 2)
            if decision != COMMIT:
                self.trainer.discard()
                _log(f"step {step} of generation {generation}: aborted by the leader")
                self.generations.wait_newer(generation, self.timeout * 2)
                return False
            report = self.trainer.commit(prepared)
            now = time.time()
            if layout.stage == 0 and layout.tp_rank == 0:
                # One writer per pipeline: a node killed right after the commit cannot lose the
                # step's report (every worker has the same global loss and norm).
                result = StepResult(
                    step=step, loss=report.loss, grad_norm=report.grad_norm, lr=report.lr,
                    seconds=time.perf_counter() - start, generation=generation, committed_at=now,
                )  # fmt: skip
                self.client.put(self.rk.result(step), result.to_json())
            if first_commit:
                first_commit = False
                seen_at, t, started = self._pending_recovery
                rec = RecoveryTimings(seen_at=seen_at, transfer_s=t.transfer_s, rebuild_s=t.rebuild_s,
                                      bytes_fetched=t.bytes_fetched, started_at=started, first_commit_at=now)  # fmt: skip
                self.client.put(self.rk.recovery(generation, layout.rank), rec.to_json())
            self._maybe_checkpoint(layout)
        return True

    def _maybe_checkpoint(self, layout: ParallelLayout) -> None:
        every = self.config.checkpoint_every
        if self.writer is None or self.trainer.step % every:
            return
        from elastic.runtime.checkpoint import checkpoint_writer_shards

        mine = checkpoint_writer_shards(layout)
        if mine:
            self.writer.save_async(self.trainer.step, {k: self.trainer.export_shard(*k) for k in mine})

    def _finish(self, layout: ParallelLayout) -> None:
        """Pipeline 0 of the last generation writes the final parameters; then report done."""
        if self.writer is not None:
            self.writer.flush()
        state = self.trainer.full_state()
        if layout.pipeline == 0 and layout.tp_rank == 0:
            path = self.spec.stage_state_path(layout.stage)
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(state, path)
            if layout.stage == 0:
                (Path(self.spec.run_dir) / "final_plan.json").write_text(layout.plan.to_json())
        self.client.put(self.rk.worker_done(self.node, self.local_rank), str(self.trainer.step))

    def close(self) -> None:
        self.generations.close()
        self.decisions.close()
        self.server.stop(grace=1.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="elastic.runtime.elastic_worker", description=__doc__)
    parser.add_argument("--etcd", required=True, help="etcd endpoint host:port")
    parser.add_argument("--job", required=True, help="job id")
    parser.add_argument("--node", type=int, required=True, help="plan node of this worker")
    parser.add_argument("--local-rank", type=int, required=True, help="worker index inside the node")
    parser.add_argument("--incarnation", type=int, required=True, help="incarnation of the node")
    parser.add_argument("--lease", type=int, required=True, help="the node's etcd lease id")
    args = parser.parse_args(argv)
    agent_pid = os.environ.get("ELASTIC_AGENT_PID")
    if agent_pid:  # an orphan of a SIGKILLed agent would train on unmonitored: die with it
        die_with_parent(int(agent_pid))
    token = os.environ.get(TOKEN_ENV, "")
    client = connect(EtcdConfig(endpoint=args.etcd))
    keys = JobKeys(args.job)
    try:
        admit(client, keys, token or None)
    except JobAccessError as exc:  # refused before writing anything under the job
        print(f"elastic worker: error: {exc}", file=sys.stderr)
        return 4  # agent.EXIT_REFUSED
    value, _ = client.get(RunKeys(keys).config)
    if value is None:
        raise SystemExit(f"job {args.job} has no config in etcd at {args.etcd}")
    worker = ElasticWorker(
        client=client, keys=keys, config=ElasticConfig.from_json(value), token=token, node=args.node,
        local_rank=args.local_rank, incarnation=args.incarnation, lease=args.lease,
    )  # fmt: skip
    try:
        worker.run()
    finally:
        worker.close()
    # Skip interpreter teardown: destructors of old generations' gloo groups (kept alive on
    # purpose, see the contract) may abort the process on exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
