"""The node side of bench/control_plane_light.py: light simulated nodes, every etcd request real.

A `LightShard` is one process of the light bench, served over a pipe with the same protocol as
bench/control_plane_shard.py's `Shard` (`cmd_<name>` commands). It hosts a block of nodes; a
`LightNode` makes every etcd request a real node of the runtime makes for the control plane, with
the runtime's own classes where the request is issued:

- the agent: its member lease and key (`Membership`), its election candidate (`LeaderElection`:
  campaign, watch, the standby re-check every 5 s), its `InjectionTrigger` (only the nodes told
  to wait on a step watch `progress`, as in the runtime) and its watch on `injections/`;
- the agent's relay: one watch a prefix a node on `plan/`, `halt/` and `decisions/`
  (`watch_from_now`, what `FeedHub` opens), and one transaction a node for its G workers' sync
  reports folded into one key, with their holdings where they changed (each report and holding
  built by the worker's own `write_sync`, collected instead of sent over the relay's socket),
  and one for their recovery records folded into one (`write_batch`, the relay's write);
- the workers: their registrations, folded into `workers/<node>/all` (one transaction a node), their `HaltFeed` and `DecisionFeed`
  (fed by the node's watch, as through the relay), and world rank 0's `ProgressWriter`;
- node 0's `Leader`, elected first. The standby agents' Leaders make no etcd request while
  standby (they wait on their election locally) and are not started.

What is charged instead of run: the G workers of a node receive a generation record from their
agent and decode it (`GenerationRecord.from_json`, then the plan's ranks), in parallel, each in
its process. Here the first node of the shard to receive generation g decodes it once, timed by
`thread_time`, and every node's workers have g at its watch's arrival time plus that cost. The
per-step checks of a worker (two local lookups, microseconds: bench/control_plane_scale.py) make
no etcd request and are not run.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from bench.control_plane_shard import (
    SIM_RETRY_S,
    NodeHost,
    TimedTrigger,
    in_parallel,
    join_member,
    stop_agent,
    worker_info,
)
from elastic.coordinator import (
    EtcdConfig,
    LeaderElection,
    connect,
)
from elastic.coordinator.generations import Generation, Generations
from elastic.coordinator.keys import RunKeys
from elastic.coordinator.watch import Cancelable, PrefixWatch, watch_from_now
from elastic.parallel.layout import WorkerCoord, assign_ranks
from elastic.records.generation import GenerationRecord, Vote
from elastic.records.node_workers import registration
from elastic.records.progress import StepResult
from elastic.records.recovery_timings import ReconfigTimings, RecoveryTimings
from elastic.records.sync import SyncReport
from elastic.records.workers import node_id
from elastic.roles.etcd_writes import Fold, Put, write_batch
from elastic.roles.injection_trigger import InjectionTrigger
from elastic.roles.leader import Leader
from elastic.roles.worker_feeds import DecisionFeed, HaltFeed, ProgressWriter, write_sync

WRITERS = 16
"""Threads a shard writes its nodes' transactions with (a real node writes its own)."""
STARTERS = 4
"""Threads a shard starts its agents with (many at once starve the running ones' lease keep-alives)."""


def _say_failure(future: Future[None]) -> None:
    """A writer's exception, on stderr (a pool's future keeps it otherwise, and the bench would
    only time out waiting for the reports)."""
    if (exc := future.exception()) is not None:
        print(f"light shard: a halted node's report failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)


class Collector:
    """Takes a worker's puts where its relay client would send them (`write_sync(relay=...)`)."""

    def __init__(self) -> None:
        self.puts: list[Put] = []
        self.folds: list[Fold] = []

    def put(self, puts: list[Put], folds: list[Fold] | None = None) -> None:
        self.puts.extend(puts)
        self.folds.extend(folds or [])


class Decoded:
    """Each generation record decoded once a shard, with the CPU seconds that took."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done: dict[int, Generation1] = {}

    def get(self, gen: Generation) -> Generation1:
        with self._lock:
            if gen.number not in self._done:
                t0 = time.thread_time()
                record = GenerationRecord.from_json(gen.plan)
                ranks = {(w.node, w.local_rank): w for w in assign_ranks(record.plan)}
                done = Generation1(record=record, ranks=ranks, cost_s=0.0)
                done.by_node  # noqa: B018 - built inside the timed decode: a worker finds its own coordinates
                done.cost_s = time.thread_time() - t0
                self._done[gen.number] = done
            return self._done[gen.number]

    def __getitem__(self, number: int) -> Generation1:
        with self._lock:
            return self._done[number]


@dataclass(kw_only=True)
class Generation1:
    """One generation as a worker holds it once decoded."""

    record: GenerationRecord
    ranks: dict[tuple[int, int], WorkerCoord]
    """(node, local rank) -> the worker's coordinates."""
    cost_s: float
    """CPU seconds of the decode (the record, then the ranks)."""

    def held(self, node: int) -> list[tuple[int, int]]:
        """(layer, local rank) of every layer shard `node`'s workers hold in this generation."""
        plan = self.record.plan
        return [(layer, w.local_rank) for w in self.by_node.get(node, [])
                for layer in range(*plan.pipelines[w.pipeline].stages[w.stage].layers)]

    @functools.cached_property
    def by_node(self) -> dict[int, list[WorkerCoord]]:
        out: dict[int, list[WorkerCoord]] = {}
        for w in self.ranks.values():
            out.setdefault(w.node, []).append(w)
        return out


class LightNode:
    """One node's control-plane requests (module doc)."""

    def __init__(self, shard: LightShard, client: Any, node: int) -> None:
        self.shard, self.client, self.node = shard, client, node
        keys, config, gpus = shard.keys, shard.config, shard.spec.gpus
        self.rk, self.who = RunKeys(keys), node_id(node)
        self.membership, self.lease = join_member(client, keys, config, node, gpus)
        # its workers' registrations, folded into the node's one key (as its agent's relay does)
        write_batch(client, [], [registration(self.rk, node, lr, worker_info(node, lr), self.lease)
                                 for lr in range(gpus)], {})
        self.generation = 0
        self.aborted: dict[int, float] = {}
        self.held: dict[int, list[tuple[int, int]]] = {}
        self.held_written: dict[int, list[tuple[int, int]]] = {}
        """Local rank -> the holdings its worker last wrote."""
        self.seen: dict[int, float] = {}
        self.arrived: dict[int, float] = {}
        self.synced: dict[int, float] = {}
        self.entered: dict[int, float] = {}
        self.watches: list[Cancelable] = []
        self.halts: HaltFeed | None = None
        self.decisions: DecisionFeed | None = None
        self.election: LeaderElection | None = None
        self.leader: Leader | None = None
        self.trigger: InjectionTrigger | None = None
        self.progress: ProgressWriter | None = None

    # -- the agent -------------------------------------------------------------------------------

    def start_agent(self, *, leads: bool, waits: bool) -> None:
        """Election (and node 0's Leader), trigger, the injections watch, the relay's three watches."""
        keys, config = self.shard.keys, self.shard.config
        self.election = LeaderElection(self.client, keys, self.who, ttl=config.lease_ttl).start()
        if leads:
            self.leader = Leader(self.client, keys, config, self.election, who=self.who).start()
        self.trigger = TimedTrigger(self.client, keys) if waits else InjectionTrigger(self.client, keys)
        self.watches.append(watch_from_now(self.client, keys.injections, lambda evs: None))

        def follow(prefix: str, on_events: Any) -> PrefixWatch:
            w = watch_from_now(self.client, prefix, on_events)
            self.watches.append(w)
            return w

        self.halts = HaltFeed(self.client, self.rk, subscribe=follow)
        self.decisions = DecisionFeed(self.client, self.rk, subscribe=follow)
        self.watches.append(Generations(self.client, keys).watch(self._on_generation, after=0, subscribe=follow))

    def _on_generation(self, gen: Generation) -> None:
        at = time.time()
        decoded = self.shard.decoded.get(gen)
        self.arrived[gen.number] = at
        self.seen[gen.number] = at + decoded.cost_s
        self.held[gen.number] = decoded.held(self.node)
        if 0 < self.generation < gen.number:
            self.set(f"generation {gen.number} published")  # as GenerationFeed's abort

    # -- the workers -----------------------------------------------------------------------------

    def enter(self, generation: int) -> None:
        """The node's workers enter `generation`: the feeds, then their recovery records folded into
        the node's one, one transaction (the relay's write of what its G workers sent)."""
        assert self.halts is not None
        self.generation = generation
        self.halts.enter(generation, self)
        ranks = self.shard.decoded[generation].ranks
        now = time.time()
        key = self.rk.recovery(generation, self.node)
        folds: list[Fold] = []
        for lr in range(self.shard.spec.gpus):
            rec = RecoveryTimings(ranks=[ranks[(self.node, lr)].rank], seen_at=self.seen.get(generation, now),
                                  started_at=now, first_commit_at=now,
                                  reconfig=ReconfigTimings(transfer_s=0.0, rebuild_s=0.0, bytes_fetched=0))
            folds.append((key, rec))
        write_batch(self.client, [], folds, {})
        self.entered[generation] = time.time()

    def set(self, reason: str, *, local: bool = False) -> None:
        """The halt feed's abort (an `Abortable`): the node's workers report, once a generation."""
        with self.shard.lock:
            g = self.generation
            if g in self.aborted:
                return
            self.aborted[g] = time.time()
        self.shard.writers.submit(self._report_halted, g).add_done_callback(_say_failure)

    def is_set(self) -> bool:
        return self.generation in self.aborted

    def _report_halted(self, generation: int) -> None:
        committed = self.shard.committed
        vote = Vote(step=committed - 1, grad_norm=1.0, loss=2.0) if committed else None
        collect = Collector()
        for lr in range(self.shard.spec.gpus):
            report = SyncReport(committed=committed, pending=None, last_vote=vote, node=self.node, local_rank=lr)
            held = sorted(h for h in self.held.get(generation, []) if h[1] == lr)
            same = self.held_written.get(lr) == held  # as the worker: written when it changed
            write_sync(self.client, self.rk, generation, report, holdings=None if same else held, lease=self.lease,
                       relay=collect)  # type: ignore[arg-type]
            self.held_written[lr] = held
        write_batch(self.client, collect.puts, collect.folds, {})
        self.synced[generation] = time.time()

    def publish(self, step: int) -> float:
        """World rank 0's progress put of `step`; the seconds the call took."""
        if self.progress is None:
            self.progress = ProgressWriter(self.client, self.rk)
        t0 = time.perf_counter()
        self.progress.publish(StepResult(step=step, loss=2.0, grad_norm=1.0, lr=1e-4, seconds=0.02,
                                         generation=self.generation, committed_at=time.time()))
        return time.perf_counter() - t0

    def kill(self) -> None:
        """Every process of the node is gone (its member stays until reported)."""
        self.close()

    def close(self) -> None:
        for w in self.watches:
            w.cancel()
        self.watches = []
        for closable in (self.progress, self.halts, self.decisions):
            if closable is not None:
                closable.close()
        stop_agent(self.trigger, self.leader, self.election)
        self.progress = self.halts = self.decisions = self.trigger = self.leader = self.election = None


class LightShard(NodeHost):
    """The light nodes of one shard process and the parent's commands (`cmd_<name>`)."""

    nodes: dict[int, LightNode]

    def __init__(self, spec: Any) -> None:
        super().__init__(spec)
        self.decoded = Decoded()
        self.lock = threading.Lock()
        self.writers = ThreadPoolExecutor(max_workers=WRITERS, thread_name_prefix="writer")
        self.committed = 0
        """Steps every worker has committed (the parent's clock; nothing ticks during a change)."""
        self.rank0: LightNode | None = None
        self.publish_at: dict[int, float] = {}
        self.publish_s: list[float] = []

    # -- setup ----------------------------------------------------------------------------------

    def cmd_setup(self) -> dict[str, Any]:
        """The etcd clients (one per `nodes_per_client` nodes; 1: one a node, as real agents),
        the nodes' members and their workers' registrations."""
        t0 = time.perf_counter()
        per = max(1, self.spec.nodes_per_client)
        blocks = [self.spec.nodes[i:i + per] for i in range(0, len(self.spec.nodes), per)]
        self.clients = in_parallel([
            functools.partial(connect, EtcdConfig(endpoint=self.spec.endpoint, retry_s=SIM_RETRY_S)) for _ in blocks
        ])
        made = in_parallel([functools.partial(LightNode, self, c, n)
                            for c, block in zip(self.clients, blocks, strict=True) for n in block])
        self.nodes = {n.node: n for n in made}
        return {"pid": os.getpid(), "seconds": round(time.perf_counter() - t0, 3), "clients": len(self.clients)}

    def cmd_start_agents(self, which: list[int] | None, leader: int, waiting: list[int]) -> None:
        """Start the agents of `which` nodes (None: every node without one yet); `leader` runs
        the Leader; the nodes in `waiting` have an injection waiting on a step."""
        in_parallel([functools.partial(n.start_agent, leads=n.node == leader, waits=n.node in waiting)
                     for n in self._agentless(which)], threads=STARTERS)

    def cmd_enter(self, generation: int) -> None:
        """Every live node's workers enter `generation` (feeds, then their recovery records)."""
        in_parallel([functools.partial(n.enter, generation) for n in self._live()], threads=WRITERS)

    # -- steps ----------------------------------------------------------------------------------

    def cmd_rank0(self, node: int) -> None:
        self.rank0 = self.nodes[node]

    def cmd_tick(self, step: int, at: float) -> None:
        """Posted: step `step`'s vote completed at `at`; world rank 0 publishes it."""
        self.committed = step + 1
        if self.rank0 is not None:
            self.publish_at[step] = time.time()
            self.publish_s.append(self.rank0.publish(step))

    def cmd_set_committed(self, steps: int) -> None:
        self.committed = steps

    def cmd_triggers(self, step: int) -> bool:
        """Whether every waiting node's trigger has seen `step` committed."""
        return all(t.seen.get(step) is not None for t in self._timed())

    def _timed(self) -> list[TimedTrigger]:
        return [n.trigger for n in self._live() if isinstance(n.trigger, TimedTrigger)]

    def cmd_steady(self) -> dict[str, Any]:
        timed = self._timed()
        return {"publish_at": self.publish_at, "publish_s": self.publish_s,
                "seen": [dict(t.seen) for t in timed], "trigger_events": sum(t.events for t in timed),
                "waiting": len(timed),
                "progress_puts": 0 if self.rank0 is None or self.rank0.progress is None else self.rank0.progress.puts}

    # -- a generation change --------------------------------------------------------------------

    def cmd_change_status(self, generation: int) -> dict[str, bool]:
        live = self._live()
        return {"seen": all(generation in n.seen for n in live),
                "synced": all(generation - 1 in n.synced for n in live)}

    def cmd_change(self, generation: int) -> dict[str, Any]:
        """The live nodes' abort, sync, arrival, seen and entered times of the change to `generation`."""
        live = self._live()
        decoded = self.decoded[generation]
        return {
            "aborts": [n.aborted[generation - 1] for n in live],
            "synced": [n.synced[generation - 1] for n in live],
            "arrived": [n.arrived[generation] for n in live],
            "seen": [n.seen[generation] for n in live],
            "entered": [n.entered[generation] for n in live if generation in n.entered],
            "decode_s": decoded.cost_s,
            "record": decoded.record.to_json(),
            "leases_lost": self._leases_lost(),
        }

    # -- teardown -------------------------------------------------------------------------------

    def cmd_teardown(self, stage: str) -> None:
        nodes = self._live()
        if stage in ("stop_drivers", "close_workers"):
            return
        if stage == "close_agents":
            in_parallel([n.close for n in nodes], threads=32)
            return
        if stage == "exit":
            self.writers.shutdown(wait=False)
        self._end(stage, nodes)
