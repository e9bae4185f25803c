"""Elastic worker: `python -m elastic.roles.elastic_worker --etcd HOST:PORT --job J --node N ...`.

One process per (node, device), started by its node's agent and alive for the whole job. Its
loop, per step s of generation g: prepare (forward, backward, gradient reductions, and the
vote: a world all-reduce of norm, loss, ok and halt flags) -> commit as soon as the vote
completes, without asking etcd. World rank 0 hands the step to the progress writer; each
pipeline's first worker appends it to its local step log. The job's last step alone waits for
the leader's decision (`ready/`, `decisions/`). A watcher on generations and one on halts set
the generation's AbortSignal when the leader halts g with abort or publishes g+1, which frees a
step blocked on a dead or stopped peer; a boundary halt (a join, a drain) is voted into the
next step, after which every worker stops. A halted worker writes its sync report (what it
committed, and a step whose vote was cut short here) and waits for g+1, whose record says
which step to resume at and, for a worker whose vote was cut short, the vote to complete it
with. At the boundary the worker moves to the newest generation that includes it: it lets its
ShardServer serve that generation (its committed state), then `Trainer.start` keeps the shards
it holds, fetches the missing ones from live holders (or from the checkpoint the leader names)
and builds the new groups. A worker whose node was drained (`elastic drain`: a generation
without it, naming it in `drained`) serves its committed shards to the survivors until a newer
generation has committed a step, then reports itself done and exits 0. A worker of a hot spare
(`elastic run --spares`, or a node back while the plan has all its nodes) waits outside every
generation with its model skeleton built and no layers, for as long as the job runs: the
generation that puts its node into a lost or drained node's stage is entered like any other; if
the job finishes first it reports itself done ("spare") and exits 0. A whole-job stop
(elastic/records/stop.py: `elastic run`'s first Ctrl-C or SIGTERM, `elastic drain --all`) is a
boundary halt that the leader, once every worker reported, marks with the step S they all
committed: each worker writes its checkpoint shards of step S (as `--checkpoint-every` would),
waits until they are on disk, reports itself done ("stopped") and exits 0. The job token comes
in the ELASTIC_JOB_TOKEN environment variable.
"""

from __future__ import annotations

import argparse
import faulthandler
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist

from elastic.coordinator.access import JobAccessError, admit
from elastic.coordinator.client import config_from_env, connect
from elastic.coordinator.etcd_api import EtcdClient
from elastic.coordinator.events import record_event
from elastic.coordinator.generations import Generations
from elastic.coordinator.keys import JobKeys, RunKeys
from elastic.coordinator.monitor import die_with_parent
from elastic.coordinator.netaddr import bind_host
from elastic.coordinator.store import EtcdStore
from elastic.engine.eval import eval_due
from elastic.engine.step import NonFiniteStep
from elastic.engine.trainer import Trainer
from elastic.parallel.abort import AbortSignal
from elastic.parallel.layout import ParallelLayout
from elastic.parallel.phase_clock import StepPhases
from elastic.records.checkpoint_failures import SaveFailures, save_failures_key
from elastic.records.config import ElasticConfig
from elastic.records.evals import EvalResult, append_eval_log, eval_key
from elastic.records.generation import GenerationRecord, Vote
from elastic.records.progress import StepResult, read_progress, step_log_path
from elastic.records.recovery_timings import RecoveryTimings
from elastic.records.stop import STOPPED
from elastic.records.sync import COMMIT, SyncReport
from elastic.records.workers import WorkerInfo
from elastic.roles.control import DecisionFeed, GenerationFeed, HaltFeed, ProgressWriter, write_sync
from elastic.roles.holders import HolderMap, holder_map_reader
from elastic.roles.node_feed import subscriber
from elastic.roles.node_relay import put_all, relay_from_env
from elastic.roles.start_phases import worker_stamps
from elastic.roles.straggler_reporter import StragglerReporter
from elastic.transfer.client import FetchConfig, fetch_shards
from elastic.transfer.server import ServerConfig, ShardServer
from elastic.transfer.shards import ShardKey
from elastic.transfer.tls import TlsConfig

TOKEN_ENV = "ELASTIC_JOB_TOKEN"
GLOO_LAZY_ENV = "TORCH_GLOO_LAZY_INIT"
_STORE_SLICE_S = 0.2
_LOCAL_GRACE_MIN_S = 1.0
_LOCAL_GRACE_FIRST_S = 5.0
_SPARE_POLL_S = 1.0
"""How often a hot spare that no generation includes looks whether the job has finished."""
_STOP_LOOK_S = 0.05
"""How often a worker halted at a step boundary looks whether the leader stopped the job there
(a newer generation ends the wait at once)."""


def _local_grace(step_s: float | None) -> float:
    """How long a pipeline that lost no node may go on finishing its microbatches after a
    failure elsewhere: two steps (the last one's time), at least a second; 5 s before any step.
    It also bounds a wait on a pipeline peer that stopped at the step before (its vote was cut
    short while this worker's completed and it went on)."""
    return _LOCAL_GRACE_FIRST_S if step_s is None else max(_LOCAL_GRACE_MIN_S, 2.0 * step_s)


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class AbortableStore(EtcdStore):
    """The generation's etcd Store, whose blocking waits end as soon as the generation is
    aborted: a rendezvous with a peer that died during the reconfiguration does not wait out
    the store timeout."""

    def __init__(self, client: EtcdClient, prefix: str, *, timeout: timedelta, abort: AbortSignal) -> None:
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


class Drained(Exception):
    """This worker's node was drained out of the job by generation `generation`."""

    def __init__(self, generation: int) -> None:
        super().__init__(f"drained by generation {generation}")
        self.generation = generation


class SpareDone(Exception):
    """This worker's node was a hot spare to the end: the job finished without needing it."""


class Stopped(Exception):
    """The whole job stops after `step` committed steps (elastic/records/stop.py)."""

    def __init__(self, step: int, layout: ParallelLayout) -> None:
        super().__init__(f"the job stops after step {step}")
        self.step, self.layout = step, layout


class ElasticWorker:
    """The worker loop of the module doc."""

    def __init__(self, *, client: EtcdClient, keys: JobKeys, config: ElasticConfig, token: str,
                 node: int, local_rank: int, incarnation: int, lease: int, main_at: float) -> None:
        self.client, self.keys, self.rk = client, keys, RunKeys(keys)
        self.config, self.spec, self.token = config, config.spec, token
        self.node, self.local_rank, self.incarnation = node, local_rank, incarnation
        torch.set_num_threads(self.spec.threads_per_worker)
        self.trainer = Trainer(self.spec, node=node, local_rank=local_rank)
        self.tls = TlsConfig.from_env()  # mutual TLS of the gRPC shard path, when the environment sets it
        self.server = ShardServer(
            ServerConfig(token=token, host=bind_host(), tls=self.tls),
            provider=lambda layer, tp: self.trainer.export_shard(layer, tp),
        ).start()
        info = WorkerInfo(pid=os.getpid(), transfer_address=self.server.address, incarnation=incarnation,
                          started=worker_stamps(main_at))
        client.put(self.rk.worker(node, local_rank), info.to_json(), lease=lease)
        self.lease = lease
        self.relay = relay_from_env()
        """This node's agent's relay: a change's reports leave the node as one etcd transaction."""
        # The records every worker follows come through the agent, which watches each once for the node.
        follow = subscriber(client, self.relay.name if self.relay is not None else None)
        self.generations = GenerationFeed(Generations(client, keys), subscribe=follow)
        self.halts = HaltFeed(client, self.rk, subscribe=follow)
        self.decisions = DecisionFeed(client, self.rk, subscribe=follow)
        self.progress = ProgressWriter(client, self.rk)
        self.stragglers: StragglerReporter | None = None
        """Speed factors and straggler marks, while this worker is world rank 0."""
        self._step_log: TextIO | None = None
        self._abort = AbortSignal()
        """The current generation's abort flag."""
        self._joined = False
        """Whether this worker has entered a generation (until then its node is a hot spare)."""
        self._spare_skeleton: torch.nn.Module | None = None
        """A hot spare's model skeleton (meta device: shapes, no memory), built while it waits."""
        self.timeout = self.spec.collective_timeout_s
        self.writer: Any = None
        self._save_failures = 0
        """Checkpoint saves of this worker that failed so far (`_report_failed_saves`)."""
        if config.checkpoint_every > 0:
            from elastic.engine.checkpoint import CheckpointWriter

            cfg = self.spec.model_config
            self.writer = CheckpointWriter(
                Path(config.checkpoint_path),
                num_layers=cfg.num_layers,
                tp_degree=self.spec.plan.gpus_per_node,
            )
            self.writer.warm()  # its thread imports torch.distributed.checkpoint while we register

    # ---- the loop ------------------------------------------------------------------------

    def run(self) -> None:
        try:
            layout = self._run_generations()
        except Drained as drained:
            self._leave_drained(drained.generation)
            return
        except SpareDone:
            _log("the job finished or stopped while this node was a hot spare: leaving")
            self.client.put(self.rk.worker_done(self.node, self.local_rank), "spare")
            return
        except Stopped as stopped:
            self._leave_stopped(stopped.step, stopped.layout)
            return
        self._finish(layout)

    def _run_generations(self) -> ParallelLayout:
        """Train through every generation that includes this node; the last one's layout."""
        generation = self._next_generation(0)
        while True:
            try:
                layout = self._reconfigure(generation)
            except Exception as exc:  # aborted by a halt or g+1, or a peer died while groups were built
                _log(f"reconfiguration into generation {generation} failed: {type(exc).__name__}: {exc}")
                self._report_halted(generation)
                generation = self._next_generation(generation)
                continue
            if self._train(generation, layout):
                return layout
            self._report_halted(generation)
            self._await_stop(generation, layout)
            generation = self._next_generation(generation)

    def _report_halted(self, generation: int) -> None:
        """Write this worker's sync report of `generation`, which it has stopped working in."""
        t = self.trainer
        joined = t.generation == generation
        last = t.last_report
        vote = None if last is None else Vote(step=last.step, grad_norm=last.grad_norm, loss=last.loss)
        kept = t.kept
        report = SyncReport(committed=t.step if joined else None, pending=t.pending if joined else None,
                            last_vote=vote, node=self.node, local_rank=self.local_rank,
                            partial=None if kept is None else kept.report())
        write_sync(self.client, self.rk, generation, report, holdings=t.holdings(), lease=self.lease, relay=self.relay)
        _log(f"generation {generation} halted here: committed {report.committed}, pending {report.pending}"
             + ("" if kept is None else f", kept the sums of microbatches {list(kept.microbatches)}"))

    def _await_stop(self, generation: int, layout: ParallelLayout) -> None:
        """After a boundary halt of `generation`: wait for the next generation, or for the leader
        to mark the halt as the job's stop (Stopped)."""
        deadline = time.monotonic() + self.timeout * 4
        while True:
            halt = self.halts.requested(generation)
            if halt is not None and halt.stop_step is not None:
                raise Stopped(halt.stop_step, layout)
            if halt is None or halt.abort or time.monotonic() > deadline:
                return
            try:
                self.generations.wait_newer(generation, _STOP_LOOK_S)
                return
            except TimeoutError:
                continue

    def _leave_stopped(self, step: int, layout: ParallelLayout) -> None:
        """The job stops after `step`: write this worker's checkpoint shards of that step (unless
        `--checkpoint-every` already did), wait until they are on disk, then report done."""
        assert self.trainer.step == step and self.trainer.pending is None, (
            f"the job stops after step {step}; this worker committed {self.trainer.step} "
            f"(pending {self.trainer.pending}): the leader checks every report agrees"
        )
        if self.writer is not None:
            if step % self.config.checkpoint_every:
                self._save_checkpoint(layout)
            self.writer.flush()
            self._report_failed_saves()
        _log(f"the job stops after step {step}: this worker's checkpoint shards of step {step} are on disk; leaving")
        self.progress.close()  # world rank 0: step `step` is in the progress key before the launcher sees us done
        if self.stragglers is not None:
            self.stragglers.close()
        self.client.put(self.rk.worker_done(self.node, self.local_rank), STOPPED)

    def _leave_drained(self, generation: int) -> None:
        """Serve this worker's committed shards until the survivors have them, then report done."""
        _log(f"drained by generation {generation}: serving shards until it commits a step")
        deadline = time.monotonic() + self.timeout * 4
        while not self._committed_since(generation):
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

    def _committed_since(self, generation: int) -> bool:
        """Whether some generation >= `generation` has committed a step (one key read)."""
        record = read_progress(self.client, self.rk)
        return record is not None and record.generation >= generation

    def _next_generation(self, after: int) -> int:
        """The newest generation after `after` that includes this node's incarnation."""
        while True:
            try:
                number = self.generations.wait_newer(after, _SPARE_POLL_S if after > 0 and not self._joined
                                                     else self.timeout * 4)
            except TimeoutError:
                if self._joined or after == 0:
                    raise
                self._wait_as_spare()  # a hot spare waits for as long as the job runs
                continue
            record, _ = self.generations.get(number)
            if record.incarnations.get(self.node) == self.incarnation:
                self._joined = True
                return number
            if self.node in record.drained and self.node not in record.incarnations:
                self.server.set_generation(number)  # survivors fetch from us under this generation
                raise Drained(number)
            if self._joined and self.node not in record.incarnations:
                raise RuntimeError(f"node {self.node} is not part of generation {number}: leaving the job")
            after = number
            if not self._joined:
                self._wait_as_spare()

    def _wait_as_spare(self) -> None:
        """Between two looks at the generations, as a hot spare (elastic/planning/spares.py):
        build the model skeleton once (torch and the model code are warm when a re-plan takes
        this node in), and leave (SpareDone) once every step of the job is committed."""
        if self._spare_skeleton is None:
            from elastic.model.gpt import GPTStage

            with torch.device("meta"):
                self._spare_skeleton = GPTStage(self.spec.model_config, initialise=False)
            _log("hot spare: agent and workers up, model skeleton built, no layers held")
        record = read_progress(self.client, self.rk)
        if record is not None and record.step + 1 >= self.spec.steps:
            raise SpareDone()
        halt = self.halts.requested(self.generations.latest())
        if halt is not None and halt.stop_step is not None:  # the whole job stops: nothing to wait for
            raise SpareDone()

    def _settle_pending(self, record: GenerationRecord) -> None:
        """Commit or drop the step whose vote was cut short here, as the new generation says."""
        pending, vote = self.trainer.pending, record.completed_vote
        if pending is None:
            return
        if vote is None or vote.step != pending or record.restore_checkpoint is not None:
            _log(f"step {pending}: its vote was cut short here and no survivor saw it complete: dropped")
            self.trainer.discard()
            return
        if math.isfinite(vote.grad_norm) and math.isfinite(vote.loss):
            report = self.trainer.complete_pending(grad_norm=vote.grad_norm, loss=vote.loss)
        else:
            report = self.trainer.skip(grad_norm=vote.grad_norm, loss=vote.loss)
        _log(f"step {pending}: its vote was cut short here but completed elsewhere: committed it (loss {report.loss:.4f})")
        layout = self.trainer.layout
        self._record_step(layout, report, started_at=time.time())
        self._maybe_checkpoint(layout)

    def _reconfigure(self, generation: int) -> ParallelLayout:
        record, seen_at = self.generations.get(generation)
        layout = ParallelLayout(
            plan=record.plan, generation=generation, node=self.node, local_rank=self.local_rank
        )
        last = self.trainer.last_report
        abort = AbortSignal(local_grace_s=_local_grace(last.seconds if last else None))
        self._abort = abort
        self.generations.enter(generation, abort)
        pipeline = frozenset(st.node for st in record.plan.pipelines[layout.pipeline].stages)
        self.halts.enter(generation, abort, pipeline=pipeline if self.spec.partial_replay else frozenset())
        self._settle_pending(record)
        if record.restore_checkpoint is None and self.trainer.holdings() and self.trainer.step != record.resume_step:
            _log(f"generation {generation} resumes at step {record.resume_step} but this worker is at step "
                 f"{self.trainer.step}: its shards are not the committed state")
        # Every in-flight step of the old generation is resolved: serve the committed state of `generation`.
        self.server.set_generation(generation)
        # One etcd reading for both shard paths, at the revision that published `generation`.
        holders = holder_map_reader(self.client, self.rk, revision=self.generations.revision(generation))
        fetch: Callable[[list[ShardKey]], dict[ShardKey, dict[str, torch.Tensor]]] | None
        if record.restore_checkpoint is not None:
            fetch = self._restore_fetch(generation, record)
        else:  # the first generation initialises from the seed; later ones fetch what they miss
            fetch = None if generation == 1 else self._fetch_from_holders(generation, holders)
        timings = self.trainer.start(
            plan=record.plan,
            generation=generation,
            store=AbortableStore(
                self.client,
                self.keys.store(f"gen-{generation}"),
                timeout=timedelta(seconds=self.timeout),
                abort=abort,
            ),
            abort=abort,
            fetch=fetch,
            step=record.resume_step if record.restore_checkpoint is None else record.restore_checkpoint,
            replay=record.replay if record.restore_checkpoint is None else None,
            holdings=self._holdings_fn(generation, record, holders),
        )
        self._pending_recovery = (seen_at, timings, time.time())
        _log(
            f"generation {generation}: rank {layout.rank} pipeline {layout.pipeline} stage {layout.stage} "
            f"layers {layout.layers}, transfer {timings.transfer_s:.3f} s ({timings.bytes_fetched} B), "
            f"groups and stage {timings.rebuild_s:.3f} s, resuming at step {self.trainer.step}"
        )
        return layout

    def _restore_fetch(
        self, generation: int, record: GenerationRecord
    ) -> Callable[[list[ShardKey]], dict[ShardKey, dict[str, torch.Tensor]]]:
        """For a generation that restores a checkpoint (a fallback, or a resumed run's first):
        drop any newer state held here and read the shards from the checkpoint, resharded when it
        was written at another tensor-parallel degree (elastic/engine/checkpoint_reshard.py)."""
        from elastic.engine.checkpoint_reshard import load_resharded

        if self.trainer.holdings():  # restart from the checkpoint: drop the newer state held here
            fresh = Trainer(self.spec, node=self.node, local_rank=self.local_rank)
            fresh.inherit_groups(self.trainer)  # never destroyed: an abandoned operation may be pending
            self.trainer = fresh
        ckpt = record.restore_checkpoint
        assert ckpt is not None
        directory = Path(record.restore_dir or self.config.checkpoint_path)
        cfg, degree = self.spec.model_config, record.plan.gpus_per_node
        _log(f"generation {generation}: restoring from the checkpoint of step {ckpt} in {directory}")

        def fetch(missing: list[ShardKey]) -> dict[ShardKey, dict[str, torch.Tensor]]:
            return load_resharded(directory, ckpt, missing, cfg=cfg, tp_degree=degree)

        return fetch

    def _holdings_fn(
        self, generation: int, record: GenerationRecord, holders: Callable[[], HolderMap]
    ) -> Callable[[], dict[int, list[ShardKey]]] | None:
        """For the collective shard path: rank of `generation` -> the shards it holds now, from
        the holder map etcd knows (`elastic.roles.holders`)."""
        if record.restore_checkpoint is not None or generation == 1 or self.spec.shard_transport != "collective":
            return None
        return lambda: holders().by_rank(record.plan)

    def _fetch_from_holders(
        self, generation: int, holders: Callable[[], HolderMap]
    ) -> Callable[[list[ShardKey]], dict[ShardKey, dict[str, torch.Tensor]]]:
        """For the gRPC shard path: fetch shards from the shard servers of the holder map etcd
        knows (no server is asked what it holds). A holder still resolving its step of the
        generation before answers "not yet" and is asked again, for up to the collective timeout."""
        config = FetchConfig(token=self.token, generation=generation, stall_timeout_s=min(30.0, self.timeout),
                             behind_wait_s=self.timeout, tls=self.tls)

        def fetch(missing: list[ShardKey]) -> dict[ShardKey, dict[str, torch.Tensor]]:
            known = holders()
            _log(f"generation {generation}: fetching shards {sorted(missing)} over gRPC; holder map read from "
                 f"etcd (holdings/ + workers/): {known.describe()}")
            result = fetch_shards(missing, known.by_address(exclude=self.server.address), config)
            _log(f"generation {generation}: fetched {len(result.shards)} shards over gRPC "
                 f"({result.bytes_moved} B) from {result.bytes_by_holder} in {result.seconds:.3f} s")
            return dict(result.shards)

        return fetch

    def _train(self, generation: int, layout: ParallelLayout) -> bool:
        """Run steps of `generation`; True when the job's steps are all committed, False when
        the generation was halted (or a step failed here: the leader halts it)."""
        first_commit = True
        last = self.spec.steps - 1
        while self.trainer.step < self.spec.steps:
            step = self.trainer.step
            halt = self.halts.requested(generation)
            if self.generations.latest() > generation or (halt is not None and halt.abort):
                return False
            if self._eval_due(step) and not self._evaluate(generation, layout):
                return False
            started_at = time.time()
            skipped = None
            try:
                prepared = self.trainer.prepare_step(halt=halt is not None and step != last)
            except NonFiniteStep as exc:  # every worker that saw the vote agrees: skip the step
                _log(f"step {step} of generation {generation}: SKIPPED, {exc}")
                skipped, prepared = exc, None
            except Exception as exc:  # StepAborted, VoteCutShort, StepDiscarded, a peer's death seen by gloo
                _log(f"step {step} of generation {generation} not committed: {type(exc).__name__}: {exc}")
                return False
            if step == last and not self._last_step_decided(generation, step, layout):
                self.trainer.discard()
                return False
            if skipped is not None:
                report = self.trainer.skip(grad_norm=skipped.grad_norm, loss=skipped.loss)
            else:
                assert prepared is not None
                report = self.trainer.commit(prepared)
            now = self._record_step(layout, report, started_at=started_at,
                                    phases=prepared.phases if prepared is not None else None)
            self._abort.local_grace_s = _local_grace(report.seconds)
            if first_commit:
                first_commit = False
                seen_at, t, started = self._pending_recovery
                rec = RecoveryTimings(seen_at=seen_at, reconfig=t, started_at=started, first_commit_at=now)
                put_all(self.client, self.relay, [(self.rk.recovery(generation, layout.rank), rec.to_json(), None)])
            self._maybe_checkpoint(layout)
            if prepared is not None and prepared.halt and self.trainer.step < self.spec.steps:
                _log(f"generation {generation}: halted after step {step} (voted)")
                return False
        if self._eval_due(self.trainer.step):  # after the last step; a failure here only loses it
            self._evaluate(generation, layout)
        return True

    def _eval_due(self, committed: int) -> bool:
        """Whether every worker evaluates at this step boundary (the same rule everywhere, so a
        generation that resumes at a due boundary evaluates it again)."""
        return eval_due(committed, every=self.spec.eval_every, steps=self.spec.steps)

    def _evaluate(self, generation: int, layout: ParallelLayout) -> bool:
        """Evaluate the held-out split after `trainer.step` committed steps (collective over the
        generation); world rank 0 logs the result and puts the `eval` key. False when it failed
        (a halt, a peer's death): the leader halts the generation, and the next one evaluates."""
        committed, started = self.trainer.step, time.perf_counter()
        try:
            loss = self.trainer.evaluate()
        except Exception as exc:  # StepAborted, a peer's death seen by gloo
            _log(f"evaluation after step {committed} of generation {generation} not finished: "
                 f"{type(exc).__name__}: {exc}")
            return False
        result = EvalResult(step=committed, loss=loss, batches=self.spec.eval_batches, generation=generation,
                            at=time.time(), seconds=time.perf_counter() - started)
        if layout.rank == 0:
            append_eval_log(self.spec.run_dir, self.node, self.local_rank, result)
            try:
                self.client.put(eval_key(self.keys), result.to_json())
            except Exception as exc:  # etcd unreachable: the local log keeps it for the summary
                _log(f"evaluation after step {committed}: eval key not written: {exc}")
        return True

    def _last_step_decided(self, generation: int, step: int, layout: ParallelLayout) -> bool:
        """The job's last step commits only on the leader's word: no worker may finish the job
        while a peer replays it. True for "commit"."""
        self.client.put(self.rk.ready(generation, step, layout.rank), str(time.time()))
        decision = self.decisions.wait(generation, step, self.timeout * 4)
        if decision != COMMIT:
            _log(f"step {step} of generation {generation}: aborted by the leader")
        return decision == COMMIT

    def _record_step(self, layout: ParallelLayout, result: StepResult, *, started_at: float,
                     phases: dict[int, StepPhases] | None = None) -> float:
        """Hand a committed step to the progress writer and the straggler reporter (world rank
        0) and the local step log (each pipeline's first worker); the commit's wall time. `phases`:
        each node's forward, backward and wait seconds of the step (the vote's), None for a step
        with no measure."""
        now = result.committed_at
        if layout.rank != 0 and self.stragglers is not None:  # another worker is rank 0 now: it reports
            self.stragglers.close()
            self.stragglers = None
        if layout.rank == 0:
            self.progress.publish(result)
            if phases:  # also under `off`: the reporter reads the operator's changes of policy
                if self.stragglers is None:
                    self.stragglers = StragglerReporter(self.client, self.keys, self.config.stragglers,
                                                        who=f"node{self.node}/{self.local_rank}")
                self.stragglers.observe(step=result.step, generation=result.generation, phases=phases,
                                        plan=layout.plan)
        if layout.stage == 0 and layout.tp_rank == 0:
            if self._step_log is None:
                path = step_log_path(self.spec.run_dir, self.node, self.local_rank)
                path.parent.mkdir(parents=True, exist_ok=True)
                torn = path.exists() and path.stat().st_size > 0 and not path.read_bytes().endswith(b"\n")
                self._step_log = path.open("a", buffering=1)
                if torn:  # a killed predecessor's half line: end it, so this line parses
                    self._step_log.write("\n")
            self._step_log.write(result.to_json() + "\n")
        return now

    def _maybe_checkpoint(self, layout: ParallelLayout) -> None:
        every = self.config.checkpoint_every
        if self.writer is None:
            return
        self._report_failed_saves()
        if self.trainer.step % every:
            return
        self._save_checkpoint(layout)

    def _save_checkpoint(self, layout: ParallelLayout) -> None:
        """Queue this worker's checkpoint shards of the committed step (`checkpoint_writer_shards`)."""
        from elastic.engine.checkpoint import checkpoint_writer_shards

        mine = checkpoint_writer_shards(layout)
        if mine:
            self.writer.save_async(self.trainer.step, {k: self.trainer.export_shard(*k) for k in mine})

    def _report_failed_saves(self) -> None:
        """Report each checkpoint save that failed (a full or failing disk) once: an event and
        this worker's `checkpoint-failures/` record. Training goes on; the failed step left no
        marker, so a fallback takes the last complete checkpoint (records/checkpoint_failures.py)."""
        for failed in self.writer.take_failures():
            self._save_failures += 1
            _log(f"checkpoint of step {failed.step} not saved, training goes on: {failed.reason}")
            record = SaveFailures(node=self.node, local_rank=self.local_rank, incarnation=self.incarnation,
                                  count=self._save_failures, last_step=failed.step, last_reason=failed.reason,
                                  last_at=time.time())
            key = save_failures_key(self.keys, self.node, self.local_rank, self.incarnation)
            try:
                self.client.put(key, record.to_json())
                record_event(self.client, self.keys, who=f"node{self.node}/{self.local_rank}",
                             kind="checkpoint-failed", node=self.node, local_rank=self.local_rank,
                             step=failed.step, reason=failed.reason)
            except Exception as exc:  # etcd unreachable: the report is lost, training is not
                _log(f"could not report the failed checkpoint of step {failed.step}: {exc}")

    def _finish(self, layout: ParallelLayout) -> None:
        """Pipeline 0 of the last generation writes the final parameters; then report done."""
        if self.writer is not None:
            self.writer.flush()
            self._report_failed_saves()
        state = self.trainer.full_state()
        if layout.pipeline == 0 and layout.tp_rank == 0:
            path = self.spec.stage_state_path(layout.stage)
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(state, path)
            if layout.stage == 0:
                (Path(self.spec.run_dir) / "final_plan.json").write_text(layout.plan.to_json())
        self.client.put(self.rk.worker_done(self.node, self.local_rank), str(self.trainer.step))

    def close(self) -> None:
        self.progress.close()
        if self.stragglers is not None:
            self.stragglers.close()
        self.generations.close()
        self.halts.close()
        self.decisions.close()
        if self._step_log is not None:
            self._step_log.close()
        self.server.stop(grace=1.0)


def main(argv: list[str] | None = None) -> int:
    main_at = time.time()
    parser = argparse.ArgumentParser(prog="elastic.roles.elastic_worker", description=__doc__)
    parser.add_argument("--etcd", required=True, help="etcd endpoint host:port, or the members host:port,host:port,...")
    parser.add_argument("--job", required=True, help="job id")
    parser.add_argument("--node", type=int, required=True, help="plan node of this worker")
    parser.add_argument("--local-rank", type=int, required=True, help="worker index inside the node")
    parser.add_argument("--incarnation", type=int, required=True, help="incarnation of the node")
    parser.add_argument("--lease", type=int, required=True, help="the node's etcd lease id")
    args = parser.parse_args(argv)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: every thread's stack to the log
    agent_pid = os.environ.get("ELASTIC_AGENT_PID")
    if agent_pid:
        # A preemption notice is the agent's to act on (a drain: agent.py); SLURM and a process
        # group kill signal every process, and a worker dying of it would turn the drain into a
        # failure. The agent stops its workers with SIGKILL, and they die with it.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if agent_pid:  # an orphan of a SIGKILLed agent would train on unmonitored: die with it
        die_with_parent(int(agent_pid))
    # gloo groups connect each pair of ranks on its first use, not all pairs at construction: a
    # generation's rendezvous costs O(peers talked to) store reads per rank instead of O(world)
    # (bench/rendezvous_scale.py). The groups keep their store alive, as lazy connection needs.
    # TORCH_GLOO_LAZY_INIT=0 in the environment keeps the eager full mesh.
    os.environ.setdefault(GLOO_LAZY_ENV, "1")
    token = os.environ.get(TOKEN_ENV, "")
    client = connect(config_from_env(args.etcd))
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
        local_rank=args.local_rank, incarnation=args.incarnation, lease=args.lease, main_at=main_at,
    )
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
