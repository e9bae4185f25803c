"""`--partition node=N,step=S,seconds=D`: cut node N off the network while step S is in flight.

The cut downs the node's host-side veth (see topology.py): its lease keepalives, its gloo
traffic and its shard server all go silent at once, while its processes keep running. After D
seconds the link comes back up. Step S (1-based, as printed) is in flight once step S-1 is
committed, the same rule as `elastic run --inject`.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from elastic.coordinator.client import config_from_env, connect
from elastic.coordinator.keys import JobKeys
from elastic.records.protocol import RunKeys, committed_steps


@dataclass(frozen=True, kw_only=True)
class PartitionSpec:
    """One partition to inject."""

    node: int
    """Plan node to cut off."""
    step: int
    """The cut happens while this step (1-based) is in flight."""
    seconds: float
    """How long the link stays down."""

    def __post_init__(self) -> None:
        if self.node < 0:
            raise ValueError(f"partition node must be >= 0, got {self.node}")
        if self.step < 1:
            raise ValueError(f"partition step must be >= 1 (steps are numbered from 1), got {self.step}")
        if self.seconds <= 0:
            raise ValueError(f"partition seconds must be > 0, got {self.seconds}")


def parse_partition(text: str) -> PartitionSpec:
    """`node=2,step=8,seconds=6` -> PartitionSpec; ValueError naming the bad part."""
    fields: dict[str, str] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in ("node", "step", "seconds"):
            raise ValueError(f"--partition {text!r}: expected node=N,step=S,seconds=D")
        fields[key.strip()] = value.strip()
    missing = {"node", "step", "seconds"} - set(fields)
    if missing:
        raise ValueError(f"--partition {text!r}: missing {', '.join(sorted(missing))}")
    try:
        return PartitionSpec(
            node=int(fields["node"]), step=int(fields["step"]), seconds=float(fields["seconds"])
        )
    except ValueError as exc:
        raise ValueError(f"--partition {text!r}: {exc}") from None


@dataclass
class PartitionRecord:
    """When a partition happened (Unix seconds), as written to <run_dir>/partitions.json."""

    node: int
    step: int
    down_at: float = 0.0
    up_at: float = 0.0


class Partitioner:
    """A thread that waits for each spec's step, downs the node's link, and brings it back."""

    def __init__(
        self,
        specs: list[PartitionSpec],
        *,
        etcd: str,
        job: str,
        set_link: Callable[[int, bool], None],
        say: Callable[[str], None],
    ) -> None:
        self.specs = sorted(specs, key=lambda s: s.step)
        self.etcd, self.rk = etcd, RunKeys(JobKeys(job))
        self.set_link, self.say = set_link, say
        self.records: list[PartitionRecord] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._down: set[int] = set()
        self._thread = threading.Thread(target=self._run, name="partitioner", daemon=True)

    def start(self) -> Partitioner:
        self._thread.start()
        return self

    def _committed(self, client: Any) -> int:
        """Steps the job committed (the progress record: one key read)."""
        return committed_steps(client, self.rk)

    def _run(self) -> None:
        client = connect(config_from_env(self.etcd))
        try:
            for spec in self.specs:
                while self._committed(client) < spec.step - 1:
                    if self._stop.wait(0.05):
                        return
                record = PartitionRecord(node=spec.node, step=spec.step, down_at=time.time())
                self.set_link(spec.node, False)
                self._down.add(spec.node)
                self.records.append(record)
                self.say(f"netns: node {spec.node} partitioned (link down) during step {spec.step}")
                self._stop.wait(spec.seconds)
                self.set_link(spec.node, True)
                self._down.discard(spec.node)
                record.up_at = time.time()
                self.say(f"netns: node {spec.node} link back up after {record.up_at - record.down_at:.1f} s")
        except BaseException as exc:  # reported by the launcher after the run
            self.error = exc
        finally:
            client.close()

    def stop(self) -> None:
        """Stop waiting, bring back any link still down, and join the thread."""
        self._stop.set()
        self._thread.join(timeout=10.0)
        for node in list(self._down):
            self.set_link(node, True)

    def to_json(self) -> str:
        return json.dumps([asdict(r) for r in self.records], indent=1)
