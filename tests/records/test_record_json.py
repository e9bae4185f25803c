"""Every record that goes into etcd or the run directory, through its JSON form: a realistic
instance of each type round-trips, carries the schema version, and reads back from the exact text
the code before schema versions wrote (what the etcd of a running job holds); bad records give
one RecordError naming the record type and the field. The base itself:
tests/coordinator/test_jsonrecord.py."""

from __future__ import annotations

import importlib
import json
import pkgutil
from dataclasses import replace

import pytest

import elastic
from elastic.coordinator.jsonrecord import VERSION_KEY, JsonRecord, RecordError
from elastic.coordinator.membership import NodeIdentity
from elastic.engine.checkpoint.files import ShardMarker
from elastic.ops.events import HistoryEvent
from elastic.ops.run_lock import LauncherRecord
from elastic.planning.cluster import ClusterSpec
from elastic.records.checkpoint_failures import SaveFailures
from elastic.records.config import ElasticConfig
from elastic.records.evals import EvalResult
from elastic.records.generation import GenerationRecord, HaltRecord, Vote
from elastic.records.injection import Injection, parse_injection
from elastic.records.injection_requests import InjectionRequest, InjectionStatus
from elastic.records.job import JobSpec
from elastic.records.node_holdings import NodeHoldings
from elastic.records.node_sync import NodeSyncReports
from elastic.records.node_workers import NodeWorkers
from elastic.records.optim_config import OptimConfig
from elastic.records.partial import PartialReport, ReplayRecord
from elastic.records.prepared_data import PreparedData, ShardInfo, SourceInfo
from elastic.records.progress import ProgressRecord, StepResult
from elastic.records.recovery_timings import ReconfigTimings, RecoveryTimings
from elastic.records.resume import CheckpointManifest
from elastic.records.run_end import RunEnd
from elastic.records.stop import StopRequest
from elastic.records.stragglers import Mark, PolicyOverride, StragglerRecord
from elastic.records.summary import RunSummary
from elastic.records.suspicion import STALL, SuspicionRecord
from elastic.records.sync import SyncReport
from elastic.records.workers import WorkerInfo
from templates.plan import even_plan

PLAN = even_plan(num_layers=6, nodes=[0, 1, 2, 3], num_pipelines=2, global_microbatches=4, microbatch_size=2,
                 fault_tolerance=1)
SPEC = JobSpec(model="tiny", plan=PLAN, steps=12, run_dir="/runs/a", data_seed=3,
               optim=OptimConfig(lr=3e-4, min_lr=3e-5, warmup_steps=2, decay_steps=12))
VOTE = Vote(step=6, grad_norm=1.25, loss=3.5)
REPLAY = ReplayRecord(step=7, total=4, set_runs=[[[2, 4]]], set_nodes=[[1, 3]], recomputed=[],
                      moved=[[1, 0, 3, 0, 0, 0]])
PARTIAL = PartialReport(step=7, microbatches=(2, 3), layers=(3, 6), tp_rank=0)

EXAMPLES: dict[type[JsonRecord], JsonRecord] = {
    ElasticConfig: ElasticConfig(
        spec=SPEC, cluster=ClusterSpec(model="tiny", nodes=4, fault_tolerance=1),
        injections=(parse_injection("kill:node=2,step=3,at=0.5"), parse_injection("rejoin:node=2,step=8")),
        checkpoint_every=4, lease_ttl=3),
    JobSpec: SPEC,
    GenerationRecord: GenerationRecord(
        plan=PLAN, resume_step=7, incarnations={0: 0, 1: 0, 3: 0, 2: 1}, lost=[2], reason="lost node 2",
        detected_at=1000.5, published_at=1000.75, synced_at=1000.6, completed_vote=VOTE, replay=REPLAY),
    HaltRecord: HaltRecord(abort=True, reason="lost node 2", at=1000.55, lost=[2]),
    SaveFailures: SaveFailures(node=1, local_rank=0, incarnation=2, count=3, last_step=15,
                               last_reason="[Errno 28] No space left on device", last_at=1000.9),
    SyncReport: SyncReport(committed=7, pending=None, last_vote=VOTE, node=3, local_rank=0, partial=PARTIAL),
    NodeHoldings: NodeHoldings(node=3, held={0: [(0, 0), (1, 0)], 1: [(0, 1), (1, 1)], 5: []}),
    NodeWorkers: NodeWorkers(node=3, workers={0: WorkerInfo(pid=7, transfer_address="127.0.0.1:9", incarnation=2,
                                                            started={"main": 1.5}), 4: WorkerInfo(
        pid=8, transfer_address="127.0.0.1:10", incarnation=2)}),
    NodeSyncReports: NodeSyncReports.of([
        SyncReport(committed=7, pending=None, last_vote=VOTE, node=3, local_rank=0, partial=PARTIAL),
        *(SyncReport(committed=7, pending=None, last_vote=VOTE, node=3, local_rank=lr) for lr in (1, 2, 3, 5))]),
    ProgressRecord: ProgressRecord(
        step=6, loss=3.5, grad_norm=1.25, lr=2.5e-4, seconds=0.05, generation=1, committed_at=1000.4,
        recent=[[5, 1000.35, 0.05], [6, 1000.4, 0.05]], earlier=[[5, 3.6, 1.3, 2.6e-4, 0.05, 1000.35]]),
    WorkerInfo: WorkerInfo(pid=4242, transfer_address="127.0.0.1:5001", incarnation=1),
    StepResult: StepResult(step=6, loss=3.5, grad_norm=1.25, lr=2.5e-4, seconds=0.05, generation=1,
                           committed_at=1000.4),
    RecoveryTimings: RecoveryTimings(
        ranks=[2, 3], seen_at=1000.8, reconfig=ReconfigTimings(transfer_s=0.03, rebuild_s=0.02, bytes_fetched=7534112,
                                                 bytes_collective=7534112),
        started_at=1000.9, first_commit_at=1001.0),
    InjectionRequest: InjectionRequest(id="slow-node1-step5-3f2a9c", kind="slow", node=1, incarnation=0, when="step",
                                       step=5, seconds=2.0, factor=3.0, requested_at=999.0, by="cli"),
    InjectionStatus: InjectionStatus(state="done", at=1000.1, step=5, detail="slowed 2 workers"),
    NodeIdentity: NodeIdentity(node_id="node2", incarnation=1, address="10.0.0.3:5000", devices=2),
    Injection: Injection(kind="hang", node=1, step=4, at=0.25),
    PartialReport: PARTIAL,
    ReplayRecord: REPLAY,
    EvalResult: EvalResult(step=6, loss=3.25, batches=8, generation=2, at=1001.2, seconds=0.02),
    PreparedData: PreparedData(
        vocab_size=4096, tokens=300, shards=[ShardInfo(name="tokens-00000.bin", tokens=200),
                                             ShardInfo(name="tokens-00001.bin", tokens=100)],
        sources=[SourceInfo(path="/data/a.txt", bytes=1000, tokens=299)], separator_id=0,
        tokenizer_origin="trained: byte-level BPE, target vocabulary 4096"),
    ShardMarker: ShardMarker(step=10, layer=2, tp_rank=1, data="layer-0002-tp-01.0123456789ab",
                             names=["exp_avg/blocks.1.ln1.bias", "step"], num_layers=6, tp_degree=2,
                             checksums={".metadata": 305419896, "__0_0.distcp": 2882400001}),
    CheckpointManifest: CheckpointManifest(model="tiny", model_config=SPEC.model_config, global_batch=8,
                                           data_seed=3, data_path=None, optim=SPEC.optim),
    RunEnd: RunEnd(how="failed", detail="the leader gave up: no plan; 7/12 steps committed", at=1002.5,
                   launcher_pid=4242),
    LauncherRecord: LauncherRecord(pid=4242, started_at=990.0, embedded_etcd=True),
    StopRequest: StopRequest(by="sigint", requested_at=1000.95),
    StragglerRecord: StragglerRecord(step=62, generation=1, at=1004.5, policy="report", threshold=1.25,
                                     factors={0: 0.98, 1: 0.57, 2: 1.02, 3: 1.76},
                                     marked={3: Mark(since_step=62, since=1004.4, factor=1.76)},
                                     phases={3: [0.021, 0.043, 0.002]}),
    PolicyOverride: PolicyOverride(policy="auto", threshold=None, steps=20, at=1010.0),
    SuspicionRecord: SuspicionRecord(at=1012.5, suspects=[0, 1, 2, 3], answered=[0, 1, 2, 3], silent=[], mass=True,
                                     stalled=True, decision=STALL, probe_s=0.012, cleared_total=4),
}
"""A realistic instance of every JsonRecord type of the project."""

_PLAN_JSON = (
    '{"fault_tolerance": 1, "gpus_per_node": 1, "iteration_time": 0.0, "microbatch_size": 2, "num_layers": 6, '
    '"pipelines": [{"iteration_time": 0.0, "microbatches": 2, "nodes": [0, 1], "stages": [{"layers": [0, 3], '
    '"node": 0}, {"layers": [3, 6], "node": 1}]}, {"iteration_time": 0.0, "microbatches": 2, "nodes": [2, 3], '
    '"stages": [{"layers": [0, 3], "node": 2}, {"layers": [3, 6], "node": 3}]}], "schema_version": 1}'
)
_SPEC_JSON = (
    '{"collective_timeout_s": 120.0, "data_path": null, "data_seed": 3, "device": "auto", "exact_grad_sum": true, '
    '"generation": 0, "model": "tiny", "optim": {"betas": [0.9, 0.95], "decay_steps": 12, "eps": 1e-06, '
    '"grad_clip": 1.0, "lr": 0.0003, "min_lr": 3e-05, "warmup_steps": 2, "weight_decay": 0.1}, '
    f'"partial_replay": true, "plan": {_PLAN_JSON}, "run_dir": "/runs/a", "shard_transport": "collective", '
    '"steps": 12, "threads_per_worker": 1}'
)
LEGACY: dict[type[JsonRecord], str] = {
    ElasticConfig: (
        f'{{"spec": {_SPEC_JSON}, "cluster": {{"model": "tiny", "nodes": 4, "gpus_per_node": 1, "fault_tolerance": 1, '
        '"global_batch": 8, "microbatch": 2, "profile_path": null, "device_tflops": 100.0, "device_memory_gib": 80.0}, '
        '"injections": [{"kind": "kill", "node": 2, "step": 3, "when": "step", "at": 0.5}, {"kind": "rejoin", '
        '"node": 2, "step": 8, "when": "step", "at": null}], "checkpoint_every": 4, "checkpoint_dir": "", '
        '"lease_ttl": 3}'
    ),
    JobSpec: _SPEC_JSON,
    GenerationRecord: (
        '{"completed_vote": {"grad_norm": 1.25, "loss": 3.5, "step": 6}, "detected_at": 1000.5, "drained": [], '
        '"incarnations": {"0": 0, "1": 0, "2": 1, "3": 0}, "joined": [], "lost": [2], '
        f'"plan": {_PLAN_JSON}, "published_at": 1000.75, "reason": "lost node 2", "replay": {{"moved": '
        '[[1, 0, 3, 0, 0, 0]], "recomputed": [], "set_nodes": [[1, 3]], "set_runs": [[[2, 4]]], "step": 7, '
        '"total": 4, "tp": 1}, '
        '"restore_checkpoint": null, "resume_step": 7, "synced_at": 1000.6}'
    ),
    HaltRecord: '{"abort": true, "reason": "lost node 2", "at": 1000.55, "lost": [2]}',
    SyncReport: (
        '{"committed": 7, "pending": null, "last_vote": {"step": 6, "grad_norm": 1.25, "loss": 3.5}, "node": 3, '
        '"local_rank": 0, "partial": {"step": 7, "microbatches": [2, 3], "layers": [3, 6], "tp_rank": 0}}'
    ),
    ProgressRecord: (
        '{"step": 6, "loss": 3.5, "grad_norm": 1.25, "lr": 0.00025, "seconds": 0.05, "generation": 1, '
        '"committed_at": 1000.4, "recent": [[5, 1000.35, 0.05], [6, 1000.4, 0.05]], '
        '"earlier": [[5, 3.6, 1.3, 0.00026, 0.05, 1000.35]]}'
    ),
    WorkerInfo: '{"pid": 4242, "transfer_address": "127.0.0.1:5001", "incarnation": 1}',
    StepResult: (
        '{"step": 6, "loss": 3.5, "grad_norm": 1.25, "lr": 0.00025, "seconds": 0.05, "generation": 1, '
        '"committed_at": 1000.4}'
    ),
    InjectionRequest: (
        '{"at": null, "by": "cli", "factor": 3.0, "id": "slow-node1-step5-3f2a9c", "incarnation": 0, "kind": "slow", '
        '"node": 1, "requested_at": 999.0, "seconds": 2.0, "step": 5, "when": "step"}'
    ),
    InjectionStatus: '{"at": 1000.1, "detail": "slowed 2 workers", "generation": null, "state": "done", "step": 5}',
    NodeIdentity: '{"address": "10.0.0.3:5000", "devices": 2, "incarnation": 1, "node_id": "node2"}',
}
"""What the code before schema versions wrote for the etcd and run-directory records of EXAMPLES
(no "v"; RecoveryTimings flat, as it still is; ClusterSpec without network_gbps)."""


def _all_record_types() -> set[type]:
    for module in pkgutil.walk_packages(elastic.__path__, "elastic."):
        if not module.name.endswith("__main__"):
            importlib.import_module(module.name)
    out: set[type] = set()
    todo = list(JsonRecord.__subclasses__())
    while todo:
        cls = todo.pop()
        if cls.__module__.startswith("elastic."):
            out.add(cls)
        todo += cls.__subclasses__()
    return out


def test_every_record_type_has_an_example() -> None:
    assert _all_record_types() == set(EXAMPLES)


@pytest.mark.parametrize("cls", list(EXAMPLES), ids=lambda c: c.__name__)
def test_round_trip(cls: type[JsonRecord]) -> None:
    record = EXAMPLES[cls]
    assert type(record) is cls
    text = record.to_json()
    assert json.loads(text)[VERSION_KEY] == cls.VERSION
    assert cls.from_json(text) == record
    assert cls.from_dict(json.loads(json.dumps(record.to_dict()))) == record


@pytest.mark.parametrize("cls", list(LEGACY), ids=lambda c: c.__name__)
def test_records_written_before_versions_still_read(cls: type[JsonRecord]) -> None:
    assert cls.from_json(LEGACY[cls]) == EXAMPLES[cls]
    assert cls.from_json(LEGACY[cls].encode()) == EXAMPLES[cls]


RECOVERY_V2 = (
    '{"ranks": [2, 3], "seen_at": 1000.8, "transfer_s": 0.03, "rebuild_s": 0.02, "bytes_fetched": 7534112, '
    '"started_at": 1000.9, "first_commit_at": 1001.0, "bytes_collective": 7534112, "v": 2}'
)
"""A node's folded recovery record (version 2: one a node, the ranks it folds)."""


RECOVERY_V3 = (
    '{"ranks": [[2, 3]], "seen_at": 1000.8, "transfer_s": 0.03, "rebuild_s": 0.02, "bytes_fetched": 7534112, '
    '"started_at": 1000.9, "first_commit_at": 1001.0, "bytes_collective": 7534112, "node_bytes": {}, '
    '"last_revision": null, "v": 3}'
)
"""The same record in version 3: the ranks as runs, `node_bytes` and `last_revision` (a generation's
summary's)."""


def test_recovery_timings_stay_one_flat_object() -> None:
    """`elastic status`, `elastic events`, the metrics and the launcher read these keys; a
    version-2 record (ranks one by one, no node_bytes) still reads as the same record."""
    assert json.loads(EXAMPLES[RecoveryTimings].to_json()) == json.loads(RECOVERY_V3)
    assert RecoveryTimings.from_json(RECOVERY_V3) == EXAMPLES[RecoveryTimings]
    assert RecoveryTimings.from_json(RECOVERY_V2) == EXAMPLES[RecoveryTimings]


def test_a_whole_job_of_ranks_is_two_numbers() -> None:
    """A generation's summary folds every rank: written as runs, its size does not grow with the job."""
    whole = replace(EXAMPLES[RecoveryTimings], ranks=list(range(16_384)))
    assert json.loads(whole.to_json())["ranks"] == [[0, 16_383]]
    gappy = replace(whole, ranks=[0, 2, 3, 4, 9, 11, 12])
    assert json.loads(gappy.to_json())["ranks"] == [0, [2, 4], 9, [11, 12]]
    assert RecoveryTimings.from_json(gappy.to_json()) == gappy
    assert RecoveryTimings.from_json(whole.to_json()) == whole


@pytest.mark.parametrize(("runs", "message"), [
    ('[[3, 1]]', r"ranks\[0\]: run \[3, 1\] is not 1 to 16777216 integers"),
    ('[[0, 99999999999]]', r"ranks\[0\]: run \[0, 99999999999\] is not 1 to 16777216 integers"),
    ('[[1, 2, 3]]', r"ranks\[0\]: expected \[first, last\]"),
    ('[[1, "x"]]', r"ranks\[0\]: expected int, got str"),
    ('"0-3"', r"ranks: expected an array"),
])
def test_malformed_runs_are_refused_naming_the_field(runs: str, message: str) -> None:
    text = RECOVERY_V3.replace('[[2, 3]]', runs)
    with pytest.raises(RecordError, match=message):
        RecoveryTimings.from_json(text)


def test_a_recovery_record_of_one_worker_is_refused() -> None:
    """Version 1 was a worker's own record at recoveries/<g>/<rank>, without the ranks it folds:
    counting it as a node's would be wrong, so it is refused, naming the field."""
    v1 = '{"seen_at": 1000.8, "transfer_s": 0.03, "rebuild_s": 0.02, "bytes_fetched": 7, "started_at": 1000.9, ' \
         '"first_commit_at": 1001.0}'
    with pytest.raises(RecordError, match=r"^RecoveryTimings: missing field 'ranks'$"):
        RecoveryTimings.from_json(v1)


def test_job_file_is_indented_and_reads_back(tmp_path: object) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "job.json"
    SPEC.save(path)
    assert path.read_text().startswith("{\n")
    assert JobSpec.load(path) == SPEC


@pytest.mark.parametrize(
    ("cls", "text", "message"),
    [
        (ProgressRecord, '{"v": 2, "step": 1}', r"^ProgressRecord\.v: schema version 2 is newer than this code reads"),
        (StepResult, '{"step": 6, "loss": 3.5}', r"^StepResult: missing field 'grad_norm'$"),
        (WorkerInfo, '{"pid": "4242", "transfer_address": "a:1", "incarnation": 1}',
         r"^WorkerInfo\.pid: expected int, got str '4242'$"),
        (SyncReport, LEGACY[SyncReport].replace('"tp_rank": 0', '"tp_rank": "0"'),
         r"^SyncReport\.partial\.tp_rank: expected int, got str '0'$"),
        (GenerationRecord, LEGACY[GenerationRecord].replace('"schema_version": 1', '"schema_version": 7'),
         r"^GenerationRecord\.plan: unsupported plan schema_version 7"),
        (GenerationRecord, LEGACY[GenerationRecord].replace('"2": 1', '"two": 1'),
         r"^GenerationRecord\.incarnations: key 'two' is not an integer$"),
        (InjectionRequest, LEGACY[InjectionRequest].replace('"kind": "slow"', '"kind": "melt"'),
         r"^InjectionRequest\.kind: expected one of 'kill', "),
        (InjectionRequest, LEGACY[InjectionRequest].replace('"factor": 3.0', '"factor": 0.5'),
         r"^InjectionRequest: slow needs a factor > 1, got 0\.5$"),
        (InjectionRequest, LEGACY[InjectionRequest].replace('"seconds": 2.0', '"seconds": 2.0, "steps": 5'),
         r"^InjectionRequest: steps \(>= 1, instead of seconds\) apply to a slow request only, got 5 for slow "),
        (InjectionRequest, LEGACY[InjectionRequest].replace('"seconds": 2.0', '"seconds": null, "steps": 0'),
         r"^InjectionRequest: steps \(>= 1, instead of seconds\) apply to a slow request only, got 0 "),
        (ElasticConfig, LEGACY[ElasticConfig].replace('"nodes": 4', '"nodes": 0'),
         r"^ElasticConfig\.cluster: --nodes must be >= 1, got 0$"),
        (ElasticConfig, LEGACY[ElasticConfig].replace('"steps": 12', '"steps": "12"'),
         r"^ElasticConfig\.spec\.steps: expected int, got str '12'$"),
        (RecoveryTimings, RECOVERY_V2.replace('"rebuild_s": 0.02, ', ''),
         r"^RecoveryTimings: missing field 'rebuild_s'$"),
        (NodeIdentity, '{"address": "a:1", "devices": 2, "incarnation": 1, "node_id": "n", "rack": 3}',
         r"^NodeIdentity: unknown field\(s\) 'rack'$"),
    ],
)
def test_bad_records_name_the_type_and_the_field(cls: type[JsonRecord], text: str, message: str) -> None:
    with pytest.raises(RecordError, match=message):
        cls.from_json(text)


def test_outputs_carry_no_version() -> None:
    """The run summary and `elastic events --json` lines are outputs, not records read back."""
    event = HistoryEvent(kind="generation", time=None, who="leader", revision=7, key="/elastic/j/plan/2",
                         detail={"generation": 2, "lost_nodes": [2]})
    assert json.loads(event.to_json()) == {"kind": "generation", "time": None, "who": "leader", "revision": 7,
                                           "key": "/elastic/j/plan/2", "detail": {"generation": 2, "lost_nodes": [2]}}
    summary = RunSummary(steps_committed=1, losses=[3.5], tokens_per_s=10.0, steady_step_s=0.1, step_seconds=[0.1],
                         grad_norms=[1.0], global_batch=8, seq_len=64, world_size=4, pipelines=2)
    assert VERSION_KEY not in json.loads(summary.to_json())
    assert json.loads(summary.to_json()) == summary.to_dict()
