"""Elastic worker: `python -m elastic.roles.elastic_worker --etcd HOST:PORT --job J --node N ...`.

One process per (node, device), started by its node's agent and alive for the whole job. Its
loop, per step s of generation g: prepare (forward, backward, gradient reductions, and the
vote: a world all-reduce of norm, loss, ok and halt flags) -> commit as soon as the vote
completes, without asking etcd. World rank 0 hands the step to the progress writer; each
pipeline's first worker appends it to its local step log. The job's last step alone waits for
the leader's decision (`ready/`, `decisions/`). A watcher on generations and one on halts set
the generation's AbortSignal when the leader halts g with abort or publishes g+1, which frees a
step blocked on a dead or stopped peer; a boundary halt (a join, a drain) goes into the vote of
the step in flight (each worker looks right before its vote), after which every worker stops. A
halted worker writes its sync report (what it committed, and a step whose vote was cut short
here) and waits for g+1, whose record says which step to resume at and, for a worker whose vote
was cut short, the vote to complete it with. At the boundary the worker moves to the newest
generation that includes it: it lets its ShardServer serve that generation (its committed
state), then `Trainer.start` keeps the shards it holds, fetches the missing ones from live
holders (or from the checkpoint the leader names) and builds the new groups. A worker whose node was drained (`elastic drain`: a generation
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
from datetime import timedelta
from pathlib import Path

import torch

from elastic.coordinator.access import JobAccessError, admit
from elastic.coordinator.client import connect, put_through_stall
from elastic.coordinator.credentials import config_from_env
from elastic.coordinator.etcd_api import EtcdClient
from elastic.coordinator.generations import Generations
from elastic.coordinator.keys import JobKeys, RunKeys, worker_gave_up
from elastic.coordinator.monitor import die_with_parent
from elastic.coordinator.netaddr import bind_host
from elastic.coordinator.store_relay import store_relay_from_env
from elastic.engine.eval import eval_due
from elastic.engine.optim_repair import MomentsLost
from elastic.engine.step import NonFiniteStep
from elastic.engine.trainer import Trainer, held_moments
from elastic.parallel.abort import AbortSignal
from elastic.parallel.layout import ParallelLayout
from elastic.records.config import ElasticConfig
from elastic.records.evals import EvalResult, append_eval_log, eval_key
from elastic.records.generation import GenerationRecord, Vote
from elastic.records.node_workers import registration
from elastic.records.progress import read_progress
from elastic.records.recovery_timings import RecoveryTimings
from elastic.records.stop import STOPPED
from elastic.records.sync import COMMIT, SyncReport
from elastic.records.workers import WorkerInfo
from elastic.roles.abortable_store import AbortableStore
from elastic.roles.exit_codes import EXIT_REFUSED
from elastic.roles.holders import holder_map_reader
from elastic.roles.node_feed import subscriber
from elastic.roles.node_relay import put_all, relay_from_env
from elastic.roles.shard_sources import Fetch, checkpoint_fetch, collective_moves, holder_fetch
from elastic.roles.start_phases import worker_stamps
from elastic.roles.step_records import StepRecorder
from elastic.roles.worker_checkpoints import WorkerCheckpoints
from elastic.roles.worker_feeds import DecisionFeed, GenerationFeed, HaltFeed, write_sync
from elastic.roles.worker_generations import Drained, GenerationWaiter, SpareDone, Stopped
from elastic.roles.worker_log import worker_log
from elastic.transfer.server import ServerConfig, ShardServer
from elastic.transfer.shards import ShardKey
from elastic.transfer.tls import TlsConfig
from templates.plan import describe_ranges

TOKEN_ENV = "ELASTIC_JOB_TOKEN"
GLOO_LAZY_ENV = "TORCH_GLOO_LAZY_INIT"
"""1 unless given: gloo connects each pair of ranks on first use (a rendezvous costs O(peers talked to)
store reads per rank, not O(world): bench/rendezvous_scale.py), so the groups keep their store alive;
0 keeps the eager full mesh."""
_LOCAL_GRACE_MIN_S = 1.0
_LOCAL_GRACE_FIRST_S = 5.0


def _local_grace(step_s: float | None) -> float:
    """How long a pipeline that lost no node may go on finishing its microbatches after a
    failure elsewhere: two steps (the last one's time), at least a second; 5 s before any step.
    It also bounds a wait on a pipeline peer that stopped at the step before (its vote was cut
    short while this worker's completed and it went on)."""
    return _LOCAL_GRACE_FIRST_S if step_s is None else max(_LOCAL_GRACE_MIN_S, 2.0 * step_s)


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
        self.server = ShardServer(ServerConfig(token=token, host=bind_host(), tls=self.tls),
                                  provider=lambda layer, tp: self.trainer.export_shard(layer, tp)).start()
        info = WorkerInfo(pid=os.getpid(), transfer_address=self.server.address, incarnation=incarnation,
                          started=worker_stamps(main_at))
        self.lease = lease
        self.relay = relay_from_env()  # the node agent's relay: a change's reports leave the node in one etcd transaction
        self.store_relay = store_relay_from_env()  # and its store relay: a rendezvous's sets and reads
        put_all(client, self.relay, [], [registration(self.rk, node, local_rank, info, lease)])  # one key a node
        self._held_written: list[ShardKey] | None = None  # what it last wrote to its node's holdings/<node>/all
        # The records every worker follows come through the agent, which watches each once for the node.
        follow = subscriber(client, self.relay.name if self.relay is not None else None)
        self.generations = GenerationFeed(Generations(client, keys), subscribe=follow)
        self.halts = HaltFeed(client, self.rk, subscribe=follow)
        self.decisions = DecisionFeed(client, self.rk, subscribe=follow)
        self.steps = StepRecorder(client, keys, config, node=node, local_rank=local_rank)
        """Where committed steps go: the progress key, the straggler reporter, the local step log."""
        self._abort = AbortSignal()
        """The current generation's abort flag."""
        self.timeout = self.spec.collective_timeout_s
        self.waiter = GenerationWaiter(client=client, rk=self.rk, spec=self.spec, node=node, incarnation=incarnation,
                                       generations=self.generations, halts=self.halts, server=self.server,
                                       timeout=self.timeout)
        """Which generation this worker enters next (a hot spare's wait, a drain, a stop)."""
        self.checkpoints: WorkerCheckpoints | None = None
        """The checkpoint writer (`--checkpoint-every`; None without checkpoints)."""
        if config.checkpoint_every > 0:
            self.checkpoints = WorkerCheckpoints(client, keys, config, node=node, local_rank=local_rank,
                                                 incarnation=incarnation)

    # ---- the loop ------------------------------------------------------------------------

    def run(self) -> None:
        try:
            layout = self._run_generations()
        except Drained as drained:
            self._leave_drained(drained.generation)
            return
        except SpareDone:
            worker_log("the job finished or stopped while this node was a hot spare: leaving")
            self.client.put(self.rk.worker_done(self.node, self.local_rank), "spare")
            return
        except Stopped as stopped:
            self._leave_stopped(stopped.step, stopped.layout)
            return
        self._finish(layout)

    def _run_generations(self) -> ParallelLayout:
        """Train through every generation that includes this node; the last one's layout."""
        generation = self.waiter.next(0)
        while True:
            try:
                layout = self._reconfigure(generation)
            except Exception as exc:  # aborted by a halt or g+1, or a peer died while groups were built
                worker_log(f"reconfiguration into generation {generation} failed: {type(exc).__name__}: {exc}")
                if isinstance(exc, MomentsLost):  # the leader's check of the reports missed it: end the job, not hang
                    self.client.put(self.keys.fatal, worker_gave_up(f"{self.node}.{self.local_rank}", generation, exc))
                    raise
                self._report_halted(generation)
                generation = self.waiter.next(generation)
                continue
            if self._train(generation, layout):
                return layout
            self._report_halted(generation)
            self.waiter.await_stop(generation, layout)
            generation = self.waiter.next(generation)

    def _report_halted(self, generation: int) -> None:
        """Write this worker's sync report of `generation`, which it has stopped working in."""
        t = self.trainer
        joined = t.generation == generation
        last = t.last_report
        vote = None if last is None else Vote(step=last.step, grad_norm=last.grad_norm, loss=last.loss)
        kept = t.kept
        report = SyncReport(committed=t.step if joined else None, pending=t.pending if joined else None,
                            last_vote=vote, node=self.node, local_rank=self.local_rank,
                            partial=None if kept is None else kept.report(),
                            moments=held_moments(t) if self.spec.sharded_optimizer else None)
        held = sorted(t.holdings())  # written when it changed: most workers hold the same from change to change
        write_sync(self.client, self.rk, generation, report, holdings=None if held == self._held_written else held,
                   lease=self.lease, relay=self.relay)
        self._held_written = held
        worker_log(f"generation {generation} halted here: committed {report.committed}, pending {report.pending}"
             + ("" if kept is None else f", kept the sums of microbatches {list(kept.microbatches)}"))

    def _leave_stopped(self, step: int, layout: ParallelLayout) -> None:
        """The job stops after `step`: write this worker's checkpoint shards of that step (unless
        `--checkpoint-every` already did), wait until they are on disk, then report done."""
        assert self.trainer.step == step and self.trainer.pending is None, (
            f"the job stops after step {step}; this worker committed {self.trainer.step} "
            f"(pending {self.trainer.pending}): the leader checks every report agrees"
        )
        if self.checkpoints is not None:
            if step % self.config.checkpoint_every:
                self.checkpoints.save(self.trainer, layout)
            self.checkpoints.flush()
            self.checkpoints.report_failures()
        worker_log(f"the job stops after step {step}: this worker's checkpoint shards of step {step} are on disk; leaving")
        self.steps.close_reports()  # world rank 0: step `step` is in the progress key before the launcher sees us done
        self.client.put(self.rk.worker_done(self.node, self.local_rank), STOPPED)

    def _leave_drained(self, generation: int) -> None:
        """Serve this worker's committed shards until the survivors have them, then report done."""
        worker_log(f"drained by generation {generation}: serving shards until it commits a step")
        deadline = time.monotonic() + self.timeout * 4
        while not self._committed_since(generation):
            latest = self.generations.latest()
            if latest > self.server.generation:  # a failure during the drain: serve the newer one
                self.server.set_generation(latest)
            if time.monotonic() > deadline:
                worker_log(f"generation {generation} committed nothing in {self.timeout * 4:.0f} s; leaving anyway")
                break
            time.sleep(0.05)
        if self.checkpoints is not None:
            self.checkpoints.flush()
        self.client.put(self.rk.worker_done(self.node, self.local_rank), "drained")

    def _committed_since(self, generation: int) -> bool:
        """Whether some generation >= `generation` has committed a step (one key read)."""
        record = read_progress(self.client, self.rk)
        return record is not None and record.generation >= generation

    def _settle_pending(self, record: GenerationRecord) -> None:
        """Commit or drop the step whose vote was cut short here, as the new generation says."""
        pending, vote = self.trainer.pending, record.completed_vote
        if pending is None:
            return
        if vote is None or vote.step != pending or record.restore_checkpoint is not None:
            worker_log(f"step {pending}: its vote was cut short here and no survivor saw it complete: dropped")
            self.trainer.discard()
            return
        if math.isfinite(vote.grad_norm) and math.isfinite(vote.loss):
            report = self.trainer.complete_pending(grad_norm=vote.grad_norm, loss=vote.loss)
        else:
            report = self.trainer.skip(grad_norm=vote.grad_norm, loss=vote.loss)
        worker_log(f"step {pending}: its vote was cut short here but completed elsewhere: committed it (loss {report.loss:.4f})")
        layout = self.trainer.layout
        self.steps.record(layout, report)
        if self.checkpoints is not None:
            self.checkpoints.after_commit(self.trainer, layout)

    def _reconfigure(self, generation: int) -> ParallelLayout:
        record, seen_at = self.generations.get(generation)
        owners = None if record.slice_owners is None else record.owners()
        layout = ParallelLayout(plan=record.plan, generation=generation, node=self.node, local_rank=self.local_rank,
                                owners=None if owners is None else tuple(owners.values()))
        last = self.trainer.last_report
        abort = AbortSignal(local_grace_s=_local_grace(last.seconds if last else None))
        self._abort = abort
        self.generations.enter(generation, abort)
        pipeline = frozenset(st.node for st in record.plan.pipelines[layout.pipeline].stages)
        self.halts.enter(generation, abort, pipeline=pipeline if self.spec.partial_replay else frozenset())
        self._settle_pending(record)
        if record.restore_checkpoint is None and self.trainer.holdings() and self.trainer.step != record.resume_step:
            worker_log(f"generation {generation} resumes at step {record.resume_step} but this worker is at step "
                 f"{self.trainer.step}: its shards are not the committed state")
        # Every in-flight step of the old generation is resolved: serve the committed state of `generation`.
        self.server.set_generation(generation)
        # Read from etcd only if needed (a gRPC fetch), once, at the revision that published `generation`.
        holders = holder_map_reader(self.client, self.rk, revision=self.generations.revision(generation))
        fetch: Fetch | None
        if record.restore_checkpoint is not None:
            if self.trainer.holdings():  # restart from the checkpoint: drop the newer state held here
                fresh = Trainer(self.spec, node=self.node, local_rank=self.local_rank)
                fresh.inherit_groups(self.trainer)  # kept until closed: an abandoned operation may be pending
                self.trainer = fresh
            fetch = checkpoint_fetch(generation, record, spec=self.spec, checkpoint_path=self.config.checkpoint_path)
        else:  # the first generation initialises from the seed; later ones fetch what they miss
            fetch = None if generation == 1 else holder_fetch(generation, holders, token=self.token, timeout=self.timeout,
                                                              tls=self.tls, exclude=self.server.address)
        timings = self.trainer.start(
            plan=record.plan,
            generation=generation,
            store=AbortableStore(self.client, self.keys.store(f"gen-{generation}"), abort=abort,
                                 timeout=timedelta(seconds=self.timeout), relay=self.store_relay),
            abort=abort,
            fetch=fetch,
            step=record.resume_step if record.restore_checkpoint is None else record.restore_checkpoint,
            replay=record.replay if record.restore_checkpoint is None else None,
            moves=collective_moves(record), owners=owners)
        self._pending_recovery = (seen_at, timings, time.time())
        worker_log(
            f"generation {generation}: rank {layout.rank} pipeline {layout.pipeline} stage {layout.stage} "
            f"layers {describe_ranges(layout.stage_plan.ranges)}, transfer {timings.transfer_s:.3f} s ({timings.bytes_fetched} B), "
            f"groups and stage {timings.rebuild_s:.3f} s, resuming at step {self.trainer.step}"
        )
        return layout

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
            skipped = None
            try:
                prepared = self.trainer.prepare_step(  # the halt is read right before the vote, within this iteration
                    halt=lambda: step != last and self.halts.requested(generation) is not None)  # noqa: B023
            except NonFiniteStep as exc:  # every worker that saw the vote agrees: skip the step
                worker_log(f"step {step} of generation {generation}: SKIPPED, {exc}")
                skipped, prepared = exc, None
            except Exception as exc:  # StepAborted, VoteCutShort, StepDiscarded, a peer's death seen by gloo
                worker_log(f"step {step} of generation {generation} not committed: {type(exc).__name__}: {exc}")
                return False
            if step == last and not self._last_step_decided(generation, step, layout):
                self.trainer.discard()
                return False
            if skipped is not None:
                report = self.trainer.skip(grad_norm=skipped.grad_norm, loss=skipped.loss)
            else:
                assert prepared is not None
                report = self.trainer.commit(prepared)
            now = self.steps.record(layout, report, phases=prepared.phases if prepared is not None else None)
            self._abort.local_grace_s = _local_grace(report.seconds)
            if first_commit:
                first_commit = False
                seen_at, t, started = self._pending_recovery
                rec = RecoveryTimings(ranks=[layout.rank], seen_at=seen_at, reconfig=t, started_at=started,
                                      first_commit_at=now)
                put_all(self.client, self.relay, [], [(self.rk.recovery(generation, layout.node), rec)])
            if self.checkpoints is not None:
                self.checkpoints.after_commit(self.trainer, layout)
            if prepared is not None and prepared.halt and self.trainer.step < self.spec.steps:
                worker_log(f"generation {generation}: halted after step {step} (voted)")
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
            worker_log(f"evaluation after step {committed} of generation {generation} not finished: "
                 f"{type(exc).__name__}: {exc}")
            return False
        result = EvalResult(step=committed, loss=loss, batches=self.spec.eval_batches, generation=generation,
                            at=time.time(), seconds=time.perf_counter() - started)
        if layout.rank == 0:
            append_eval_log(self.spec.run_dir, self.node, self.local_rank, result)
            try:
                self.client.put(eval_key(self.keys), result.to_json())
            except Exception as exc:  # etcd unreachable: the local log keeps it for the summary
                worker_log(f"evaluation after step {committed}: eval key not written: {exc}")
        return True

    def _last_step_decided(self, generation: int, step: int, layout: ParallelLayout) -> bool:
        """The job's last step commits only on the leader's word: no worker may finish the job
        while a peer replays it. True for "commit"."""
        # an etcd stall (issue 56) is waited out, as the decision is
        put_through_stall(self.client, self.rk.ready(generation, step, layout.rank), str(time.time()), self.timeout * 4)
        decision = self.decisions.wait(generation, step, self.timeout * 4)
        if decision != COMMIT:
            worker_log(f"step {step} of generation {generation}: aborted by the leader")
        return decision == COMMIT

    def _finish(self, layout: ParallelLayout) -> None:
        """Pipeline 0 of the last generation writes the final parameters; then report done."""
        if self.checkpoints is not None:
            self.checkpoints.flush()
            self.checkpoints.report_failures()
        state = self.trainer.full_state()
        if layout.pipeline == 0 and layout.tp_rank == 0:
            path = self.spec.stage_state_path(layout.stage)
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(state, path)
            if layout.stage == 0:
                (Path(self.spec.run_dir) / "final_plan.json").write_text(layout.plan.to_json())
        self.client.put(self.rk.worker_done(self.node, self.local_rank), str(self.trainer.step))

    def close(self) -> None:
        for feed in (self.steps, self.generations, self.halts, self.decisions):
            feed.close()
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
        die_with_parent(int(agent_pid))  # an orphan of a SIGKILLed agent would train on unmonitored: die with it
    os.environ.setdefault(GLOO_LAZY_ENV, "1")  # see GLOO_LAZY_ENV
    token = os.environ.get(TOKEN_ENV, "")
    client = connect(config_from_env(args.etcd))
    keys = JobKeys(args.job)
    try:
        admit(client, keys, token or None)
    except JobAccessError as exc:  # refused before writing anything under the job
        print(f"elastic worker: error: {exc}", file=sys.stderr)
        return EXIT_REFUSED
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
    # Skip interpreter teardown: destructors of old generations' gloo groups (kept until closed,
    # elastic/engine/graveyard.py) may abort the process on exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
