"""What the launcher reads of an elastic run from etcd: committed steps, generations,
recoveries (with their breakdown) and worker PIDs, and the run summary built from them.

Nothing here scans per-step history. A `JobFeed` watches five things from the moment it is
opened: the `eval` key (one put per evaluation, `--eval-every`: a line each), the `progress` key (every put names the steps committed since the previous one, so the
launcher prints one line a step without reading any per-step key), `plan/` (one key a generation), `workers/` (one key a
node, elastic/records/node_workers.py) and `recoveries/` (one key a node a generation, folded into one a generation by the leader
once it is superseded: a delete of a node key is taken in). `poll_progress` only drains what the
watches delivered; it reads etcd only to report a recovery (the injections carried out). The run summary merges the steps the feed saw with the local step
logs of the run directory (`read_step_logs`: complete for local agents; the feed is the fallback
for agents on other hosts).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from elastic.coordinator.etcd_api import EtcdClient
from elastic.coordinator.jsonrecord import to_data
from elastic.coordinator.keys import JobKeys, RunKeys
from elastic.coordinator.watch import PrefixWatch, WatchEvent, watch_from_now
from elastic.records.config import ElasticConfig
from elastic.records.evals import EvalResult, eval_key, eval_losses, newer, read_eval_logs
from elastic.records.generation import GenerationRecord
from elastic.records.job import JobSpec
from elastic.records.node_workers import registrations
from elastic.records.progress import ProgressRecord, StepResult, read_progress, read_step_logs
from elastic.records.recoveries import change_words, interrupted, recovery_breakdown, replayed_words
from elastic.records.recovery_timings import RecoveryTimings, workers_reported
from elastic.records.summary import RunSummary, model_fields


class JobFeed:
    """Every change of `progress`, `plan/`, `workers/` and `recoveries/` of one job since it was
    opened (what was there at opening first), queued in revision order per watch until `drain`
    takes it."""

    def __init__(self, client: EtcdClient, rk: RunKeys) -> None:
        self.rk = rk
        self._lock = threading.Lock()
        self._events: list[WatchEvent] = []
        self._arrived = threading.Event()
        self._watches: list[PrefixWatch] = []
        try:
            for prefix in (rk.progress, rk.job.plans, rk.workers, rk.recoveries, eval_key(rk.job)):
                self._watches.append(watch_from_now(client, prefix, self._on_events))
        except BaseException:
            self.close()
            raise

    def _on_events(self, events: list[WatchEvent]) -> None:
        with self._lock:
            self._events.extend(events)
        self._arrived.set()

    def wait(self, timeout: float) -> bool:
        """Block until a watch delivers something or `timeout` seconds pass; whether it did."""
        arrived = self._arrived.wait(timeout)
        self._arrived.clear()
        return arrived

    def drain(self) -> list[WatchEvent]:
        """The events delivered since the last drain, oldest first."""
        with self._lock:
            events, self._events = self._events, []
        return sorted(events, key=lambda ev: ev.revision)

    def caught_up(self, revision: int) -> bool:
        """Whether the `progress` watch has delivered every change up to `revision`."""
        nxt = self._watches[0].next_revision if self._watches else None
        return nxt is not None and nxt > revision

    def wait_caught_up(self, revision: int, timeout: float) -> bool:
        """Wait (at most `timeout` seconds) until the progress watch has delivered `revision`."""
        deadline = time.monotonic() + timeout
        while not self.caught_up(revision):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def close(self) -> None:
        for watch in self._watches:
            watch.cancel()
        self._watches = []


@dataclass
class Progress:
    """What the launcher has seen of an elastic run so far (delivered by its JobFeed)."""

    results: dict[int, StepResult] = field(default_factory=dict)
    """Step -> its result as the progress records delivered it (the newest generation's)."""
    printed: set[tuple[int, int]] = field(default_factory=set)
    """(step, generation) of every step line printed."""
    generations: dict[int, GenerationRecord] = field(default_factory=dict)
    reported: set[int] = field(default_factory=set)
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    pids: dict[tuple[int, int, int], set[int]] = field(default_factory=dict)
    rejoined: set[str] = field(default_factory=set)
    last: ProgressRecord | None = None
    """The latest progress record delivered (by revision)."""
    last_revision: int = 0
    """etcd revision of `last`."""
    high_water: int = 0
    """The most steps ever seen committed (a checkpoint fallback can make `last` go back)."""
    trained: set[int] = field(default_factory=set)
    """Generations seen committing a step."""
    timings: dict[int, dict[str, RecoveryTimings]] = field(default_factory=dict)
    """Generation -> node -> its workers' timings of their reconfiguration into the generation (folded)."""
    evals: dict[int, EvalResult] = field(default_factory=dict)
    """Committed steps -> the evaluation after them (`--eval-every`; newest generation's)."""

    @property
    def committed(self) -> int:
        """Steps committed, as the latest progress record delivered says."""
        return 0 if self.last is None else self.last.step + 1

    def saw(self, record: ProgressRecord, revision: int) -> None:
        """Take in one progress record (the steps it names) written at `revision`."""
        if revision >= self.last_revision:
            self.last, self.last_revision = record, revision
        self.high_water = max(self.high_water, record.step + 1)
        self.trained.add(record.generation)
        for result in record.results():
            known = self.results.get(result.step)
            if known is None or result.generation >= known.generation:
                self.results[result.step] = result


def run_finished(client: EtcdClient, rk: RunKeys, progress: Progress, steps: int) -> bool:
    """Every step committed (the progress key, one read) and every worker of the last
    generation has its done key (read only once the steps are there)."""
    if not progress.generations:
        return False
    record = read_progress(client, rk)
    if (0 if record is None else record.step + 1) < steps:
        return False
    last = progress.generations[max(progress.generations)]
    done = {(int(m.key.decode().split("/")[-2]), int(m.key.decode().split("/")[-1]))
            for _, m in client.get_prefix(rk.done, keys_only=True)}
    return all((n, r) in done for n in last.plan.nodes for r in range(last.plan.gpus_per_node))


def step_line(r: StepResult, spec: JobSpec) -> str:
    """The line `elastic run` prints for a committed step."""
    tokens = spec.plan.global_batch * spec.model_config.seq_len
    return (f"step {r.step + 1}/{spec.steps}  loss {r.loss:.4f}  grad_norm {r.grad_norm:.3f}  lr {r.lr:.2e}  "
            f"{r.seconds * 1000:.0f} ms  {tokens / max(r.seconds, 1e-9):.0f} tok/s  (generation {r.generation})")


def eval_line(r: EvalResult, spec: JobSpec) -> str:
    """The line `elastic run` prints for an evaluation of the held-out split."""
    return (f"eval after step {r.step}/{spec.steps}  val_loss {r.loss:.4f}  ({r.batches} held-out batches, "
            f"{r.seconds * 1000:.0f} ms, generation {r.generation})")


def _take(ev: WatchEvent, rk: RunKeys, progress: Progress, say: Callable[[str], None], spec: JobSpec) -> None:
    """Apply one delivered change to `progress`, saying what a person should see."""
    if ev.kind != "put":
        if ev.key.startswith(rk.recoveries):  # node records folded into their generation's summary
            generation, writer = ev.key[len(rk.recoveries) :].split("/")[:2]
            progress.timings.get(int(generation), {}).pop(writer, None)
        return
    if ev.key == rk.progress:
        record = ProgressRecord.from_json(ev.value)
        progress.saw(record, ev.revision)
        for result in record.results():
            if (result.step, result.generation) not in progress.printed:
                progress.printed.add((result.step, result.generation))
                say(step_line(result, spec))
    elif ev.key.startswith(rk.job.plans):
        g = int(ev.key.rsplit("/", 1)[1])
        if g not in progress.generations:
            progress.generations[g] = rec = GenerationRecord.from_json(ev.value)
            if g > 1:
                say(f"elastic run: generation {g}: {rec.reason} (resume at step {rec.resume_step + 1})")
    elif ev.key.startswith(rk.workers):  # a node's registrations, or one worker's (records/node_workers.py)
        for (node, local_rank), info in registrations(rk, [(ev.key, ev.value)]).items():
            progress.pids.setdefault((node, local_rank, info.incarnation), set()).add(info.pid)
    elif ev.key.startswith(rk.recoveries):
        generation, writer = ev.key[len(rk.recoveries) :].split("/")[:2]  # writer: the node, or "all"
        progress.timings.setdefault(int(generation), {})[writer] = RecoveryTimings.from_json(ev.value)
    elif ev.key == eval_key(rk.job):
        evaluation = EvalResult.from_json(ev.value)
        if evaluation.step not in progress.evals:
            say(eval_line(evaluation, spec))
        newer(progress.evals, evaluation)


def poll_progress(
    client: EtcdClient, keys: JobKeys, config: ElasticConfig, progress: Progress, say: Callable[[str], None],
    feed: JobFeed,
) -> None:
    """Take in what `feed` delivered since the last poll and report finished recoveries."""
    rk = RunKeys(keys)
    for ev in feed.drain():
        _take(ev, rk, progress, say, config.spec)
    for g, rec in sorted(progress.generations.items()):
        if g == 1 or g in progress.reported:
            continue
        world = len(rec.plan.nodes) * rec.plan.gpus_per_node
        timings = list(progress.timings.get(g, {}).values())
        superseded = any(later > g for later in progress.generations)
        trained = g in progress.trained or bool(timings)  # a worker's timings come with its first commit
        if workers_reported(timings) < world and not (superseded and (not trained or timings)):
            continue
        progress.reported.add(g)
        if not timings:  # a further failure cut this reconfiguration short
            say(
                f"elastic run: generation {g} ({change_words(rec.lost, rec.joined, rec.drained)}) was superseded before it trained"
            )
            progress.recoveries.append(interrupted(g, rec))
            continue
        recovery = recovery_breakdown(client, rk, g, rec, timings)
        progress.recoveries.append(recovery)
        say(
            f"elastic run: recovered into generation {g} ({change_words(rec.lost, rec.joined, rec.drained)}) in "
            f"{recovery['total_s']:.2f} s: detect {recovery['detecting_s']:.2f} s, "
            f"finish in-flight work {recovery['finishing_s']:.2f} s, plan {recovery['planning_s']:.2f} s, "
            f"transfer {recovery['transferring_s']:.2f} s, rebuild groups and stage {recovery['rebuilding_s']:.2f} s, "
            f"replay {recovery['replaying_s']:.2f} s ({replayed_words(rec)}), {recovery['bytes_moved']} bytes moved "
            f"({recovery['bytes_moved_collective']} over the process group)"
            + (
                f", restored checkpoint of step {rec.restore_checkpoint}"
                if rec.restore_checkpoint is not None
                else ""
            )
        )


def final_poll(
    client: EtcdClient, keys: JobKeys, config: ElasticConfig, progress: Progress, say: Callable[[str], None],
    feed: JobFeed, *, catch_up_s: float = 5.0,
) -> None:
    """The last poll of a finished run: let the feed deliver up to the progress key's current
    revision (bounded wait), take it in, then print the line of any committed step the feed
    missed from the local step logs (a watch that lost history), so every step has its line."""
    resp = client.get_response(RunKeys(keys).progress)
    if resp.kvs:
        feed.wait_caught_up(int(resp.kvs[0].mod_revision), catch_up_s)
    poll_progress(client, keys, config, progress, say, feed)
    if resp.kvs and int(resp.kvs[0].mod_revision) > progress.last_revision:  # the feed fell behind
        progress.saw(ProgressRecord.from_json(resp.kvs[0].value), int(resp.kvs[0].mod_revision))
    shown = {step for step, _ in progress.printed}
    for step, r in sorted(merged_results(config, progress).items()):
        if step not in shown and step < progress.committed:
            progress.printed.add((step, r.generation))
            say(step_line(r, config.spec))
    for step, e in sorted(read_eval_logs(config.spec.run_dir).items()):  # evaluations the feed missed
        if step not in progress.evals:
            say(eval_line(e, config.spec))
            progress.evals[step] = e


def merged_results(config: ElasticConfig, progress: Progress) -> dict[int, StepResult]:
    """Step -> result of every step known: what the feed saw (the progress writer's own figures,
    which `elastic status` and the metrics show too), completed from the run's local step logs
    (a step the feed missed, or a newer generation's copy of a step)."""
    out = dict(progress.results)
    for step, r in read_step_logs(config.spec.run_dir).items():
        if step not in out or r.generation > out[step].generation:
            out[step] = r
    return out

def elastic_summary(config: ElasticConfig, progress: Progress, *, started_at: float) -> RunSummary:
    """The run's summary: every committed step (`merged_results`, up to the last committed one),
    recoveries, restarts and throughput."""
    spec = config.spec
    merged = merged_results(config, progress)
    committed = progress.committed or len(merged)
    results = [merged[s] for s in sorted(merged) if s < committed]
    restarts = sum(len(pids) - 1 for pids in progress.pids.values())
    tokens = spec.plan.global_batch * spec.model_config.seq_len
    seconds = [r.seconds for r in results]
    steady = seconds[1:] or seconds
    last = progress.generations[max(progress.generations)]
    wall = (results[-1].committed_at - results[0].committed_at + seconds[0]) if results else 0.0
    return RunSummary(
        steps_committed=len(results),
        losses=[r.loss for r in results],
        tokens_per_s=tokens * len(results) / wall if wall > 0 else 0.0,
        steady_step_s=statistics.median(steady) if steady else 0.0,
        step_seconds=seconds,
        grad_norms=[r.grad_norm for r in results],
        step_committed_at=[r.committed_at for r in results],
        step_generations=[r.generation for r in results],
        started_at=started_at,
        global_batch=spec.plan.global_batch,
        seq_len=spec.model_config.seq_len,
        world_size=len(last.plan.nodes) * last.plan.gpus_per_node,
        pipelines=len(last.plan.pipelines),
        recoveries=progress.recoveries,
        worker_restarts=restarts,
        startup_s=(results[0].committed_at - started_at) if results else 0.0,
        worker_pids={f"{n}/{r}/{i}": sorted(p) for (n, r, i), p in sorted(progress.pids.items())},
        eval_losses=eval_losses(_merged_evals(config, progress), up_to=len(results)),
        model=model_fields(spec),
        first_step=results[0].step if results else 0,
        resumed_from=None if config.resume is None else {**to_data(config.resume), "text": config.resume.describe()},
        init_from=spec.init_from,
    )


def _merged_evals(config: ElasticConfig, progress: Progress) -> dict[int, EvalResult]:
    """Every evaluation known: what the feed saw, completed from the run's local eval logs."""
    out = dict(progress.evals)
    for result in read_eval_logs(config.spec.run_dir).values():
        newer(out, result)
    return out
