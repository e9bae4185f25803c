"""The etcd schema table (elastic/coordinator/schema.py) lists every key the code writes.

A real elastic run (3 nodes, a node SIGKILLed mid-run and recovered from, checkpoints, evaluations,
its last step decided through etcd) is watched from before its start over the job's whole
prefix: every key it puts must match a row of the table, and the rows that such a run must
write are seen. The same matcher catches a key written outside the table (so the run test can
fail), the builders round-trip through the matcher, and no module of `elastic/` but the schema
and its key builders glues a key together from the job root or a family's prefix.
"""

from __future__ import annotations

import ast
import dataclasses
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic.coordinator import EtcdServer, schema
from elastic.coordinator.keys import JobKeys, RunKeys
from elastic.coordinator.watch import WatchEvent, watch_from_now
from elastic.records.injection import parse_injection

ROOT = Path(__file__).resolve().parents[2]


def unlisted(keys: JobKeys, written: set[str]) -> list[str]:
    """The keys of `written` that no row of the schema table matches."""
    return sorted(k for k in written if not k.startswith(keys.root) or schema.family_of(k[len(keys.root):]) is None)


def test_the_table_of_the_module_doc_is_the_table() -> None:
    assert schema.table() in (schema.__doc__ or "")
    assert len(schema.FAMILIES) == len(schema.SCHEMA), "two rows share a name"


def test_every_builder_makes_a_key_of_its_own_row() -> None:
    keys = JobKeys("j")
    rk = RunKeys(keys)
    built = {
        "members": keys.member("node1"), "failed": keys.failure("node1", 2), "leader": keys.leader,
        "suspects": keys.suspect("node1", 2, "node0"), "generation": keys.generation, "plan": keys.plan(7),
        "injections": keys.key("injections", "kill-node1-step3"), "events": keys.key("events", 5, "node1/0"),
        "token": keys.token, "fatal": keys.fatal, "store": keys.store("gen-3") + "generation/3/group/world/x",
        "config": rk.config, "workers": rk.worker(1, 0), "holdings": rk.worker_holdings(1, 0),
        "progress": rk.progress, "halt": rk.halt(3), "sync": rk.sync_report(3, 1, 0), "ready": rk.ready(3, 9, 2),
        "decisions": rk.decision(3, 9), "recoveries": rk.recovery(3, 2), "done": rk.worker_done(1, 0),
        "injected": rk.injected("kill-node1-step3"), "injection-status": rk.job.key("injection-status", "x"),
        "rdzv-store": keys.prefix("rdzv-store", 4) + "a/b", "rdzv-waiting": keys.key("rdzv-waiting", "h-1"),
        "step-waiters": keys.key("step-waiters", "0123abcd"),
    }
    for name, key in built.items():
        family = schema.family_of(key[len(keys.root):])
        assert family is not None and family.name == name, (name, key, family)
    assert keys.plan(7) == "/elastic/j/plan/000000000007"
    assert rk.prefix("ready", 3, 9) == "/elastic/j/ready/3/9/"
    assert rk.sync(3) == "/elastic/j/sync/3/"
    with pytest.raises(ValueError, match="no key family"):
        keys.key("progres")
    with pytest.raises(ValueError, match="takes its fields in order"):
        keys.key("halt")  # a key needs every field


def test_a_key_outside_the_table_is_caught() -> None:
    """What the run test asserts fails for a key that no row lists, or that breaks a row's pattern."""
    keys = JobKeys("j")
    good = {keys.leader, keys.plan(2), RunKeys(keys).sync_report(2, 0, 1)}
    assert unlisted(keys, good) == []
    bad = {keys.root + "progress-history/3", keys.root + "plan/12", keys.root + "sync/2/node0/1",
           keys.root + "leader/x", "/elastic/other/leader", keys.root + "metrics/node1/extra"}
    assert unlisted(keys, good | bad) == sorted(bad)


_GLUED = {"root", "rdzv", "members", "failed", "plans", "injections", "events", "workers", "holdings", "halts",
          "recoveries", "done"}
"""JobKeys/RunKeys prefixes that a key must not be glued onto outside the builders."""


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def _glued_keys(path: Path) -> list[str]:
    """Where `path` builds a key from a prefix by hand: `x.root + "..."`, `f"{x.root}..."`,
    `f"{x.events}{...}"`, or a literal under `/elastic/`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        parts: list[ast.expr] = []
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            parts = [node.left, node.right]
        elif isinstance(node, ast.JoinedStr):
            parts = [v.value if isinstance(v, ast.FormattedValue) else v for v in node.values]
        if (len(parts) >= 2 and isinstance(parts[0], ast.Attribute) and parts[0].attr in _GLUED
                and not isinstance(parts[1], ast.Attribute)):
            found.append(f"{_shown(path)}:{node.lineno}")
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("/elastic/"):
            found.append(f"{_shown(path)}:{node.lineno}")
    return found


def test_no_key_is_glued_together_outside_the_schema() -> None:
    exempt = {ROOT / "elastic/coordinator/schema.py", ROOT / "elastic/coordinator/keys.py"}
    found = [hit for path in sorted((ROOT / "elastic").rglob("*.py")) if path not in exempt
             for hit in _glued_keys(path)]
    assert found == []


def test_the_static_check_sees_a_glued_key(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text('def f(keys, g):\n    return keys.root + "halt-requests/", f"{keys.events}{g}-x", "/elastic/j/a"\n')
    assert _glued_keys(probe) == ["probe.py:2"] * 3


# -- a real run, watched --------------------------------------------------------------------------

MUST_SEE = {"members", "leader", "generation", "plan", "config", "token", "node-workers", "node-holdings", "progress",
            "halt", "node-sync", "ready", "decisions", "recoveries", "recovered", "done", "events", "injections",
            "injection-status",
            "injected", "eval", "metrics", "store", "step-waiters"}
"""Rows that a run with a node's loss (an injection at a step), checkpoints and evaluations writes
for sure."""


@dataclasses.dataclass
class Watched:
    keys: JobKeys
    written: set[str]
    """Every key put under the job's prefix, from before the launcher started to after its end."""


@pytest.fixture(scope="module")
def watched(etcd_server: EtcdServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Watched]:
    from tests.faults.runs import LiveJob, tiny_config

    config = tiny_config(tmp_path_factory.mktemp("schema"), nodes=3, pipelines=2, steps=7, checkpoint_every=3)
    config = dataclasses.replace(config, spec=dataclasses.replace(config.spec, eval_every=3, eval_batches=1),
                                 injections=(parse_injection("kill:node=1,step=4"),))
    job = LiveJob(config, etcd=etcd_server.endpoint, timeout_s=200.0)
    written: set[str] = set()
    seen_revision = [0]
    lock = threading.Lock()

    def on_events(events: list[WatchEvent]) -> None:
        with lock:
            written.update(ev.key for ev in events if ev.kind == "put")
            seen_revision[0] = max([seen_revision[0], *(ev.revision for ev in events)])

    watch = watch_from_now(job.client, job.keys.root, on_events)  # before anything is written
    try:
        job.start()
        summary, _ = job.result()
        assert summary.steps_committed == 7
        last = max((m.mod_revision for _, m in job.client.get_prefix(job.keys.root, keys_only=True)), default=0)
        deadline = time.monotonic() + 10.0
        while seen_revision[0] < last and time.monotonic() < deadline:  # the watch catches up
            time.sleep(0.05)
        time.sleep(0.5)  # and the deletes after the last key still there
        with lock:
            yield Watched(job.keys, set(written))
    finally:
        watch.cancel()
        job.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_key_a_real_run_writes_is_in_the_table(watched: Watched) -> None:
    assert unlisted(watched.keys, watched.written) == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_run_wrote_the_rows_it_must(watched: Watched) -> None:
    seen = {f.name for k in watched.written if (f := schema.family_of(k[len(watched.keys.root):])) is not None}
    assert seen >= MUST_SEE, sorted(MUST_SEE - seen)


def test_a_fatal_value_names_who_gave_up() -> None:
    """The launcher reads the `fatal` key through `why_failed`: the leader's reason is its own, a
    worker's (a repair that found moments lost, elastic_worker.py) names the worker and generation."""
    from elastic.coordinator.keys import why_failed, worker_gave_up

    assert why_failed("shards [3] have no live holder") == "the leader gave up: shards [3] have no live holder"
    told = why_failed(worker_gave_up("2.1", 7, RuntimeError("layer 0, elements [0, 512): no live worker")))
    assert "leader" not in told
    assert told.startswith("a worker gave up") and "worker 2.1" in told and "generation 7" in told
    assert told.endswith("layer 0, elements [0, 512): no live worker")
