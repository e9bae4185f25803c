"""Link faults injected while a given step is in flight: `--partition` and `--sick-link`.

- `--partition node=N,step=S,seconds=D`: cut node N off the network. The cut downs the node's
  host-side veth (see topology.py): its lease keepalives, its gloo traffic and its shard server
  all go silent at once, while its processes keep running.
- `--partition node=N,step=S,seconds=D,mode=oneway`: a one-way partition. Every packet node N
  sends to etcd is dropped (a blackhole route in its namespace) while it still hears etcd and
  its peers, and its peers still hear it: etcd stops hearing its keepalives, so it is fenced
  like a partitioned node.
- `--sick-link node=N,step=S,seconds=D,delay=50,loss=1`: node N's link delays every frame by
  `delay` ms and drops `loss` % of them, in each direction (sicklink.py, a user-space netem).

After D seconds the link is restored. Step S (1-based, as printed) is in flight once step S-1
is committed, the same rule as `elastic run --inject`.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal

from elastic.coordinator.client import connect
from elastic.coordinator.credentials import config_from_env
from elastic.coordinator.keys import JobKeys, RunKeys
from elastic.records.progress import committed_steps, waiting_for_steps

Mode = Literal["down", "oneway", "sick"]
"""How the link is hurt: downed, cut from the node to etcd only, or delayed and lossy."""


@dataclass(frozen=True, kw_only=True)
class PartitionSpec:
    """One link fault to inject (a partition, a one-way partition or a sick link)."""

    node: int
    """Plan node to cut off."""
    step: int
    """The cut happens while this step (1-based) is in flight."""
    seconds: float
    """How long the fault lasts."""
    mode: Mode = "down"
    """What the fault does to the link (see the module doc)."""
    delay_ms: float = 0.0
    """mode "sick": delay added to each frame, in each direction."""
    loss: float = 0.0
    """mode "sick": percent of frames dropped, in each direction."""

    def __post_init__(self) -> None:
        if self.node < 0:
            raise ValueError(f"partition node must be >= 0, got {self.node}")
        if self.step < 1:
            raise ValueError(f"partition step must be >= 1 (steps are numbered from 1), got {self.step}")
        if self.seconds <= 0:
            raise ValueError(f"partition seconds must be > 0, got {self.seconds}")
        if self.mode not in ("down", "oneway", "sick"):
            raise ValueError(f"mode must be down, oneway or sick, got {self.mode!r}")
        if not 0 <= self.delay_ms <= 10_000:
            raise ValueError(f"delay must be in 0..10000 ms, got {self.delay_ms:g}")
        if not 0 <= self.loss <= 100:
            raise ValueError(f"loss must be in 0..100 %, got {self.loss:g}")
        if self.mode == "sick" and self.delay_ms == 0 and self.loss == 0:
            raise ValueError("a sick link needs delay=MS or loss=PERCENT (or both)")

    def describe(self) -> str:
        """What is done to the node's link, for the launcher's log lines."""
        if self.mode == "sick":
            return f"link sick ({self.delay_ms:g} ms delay, {self.loss:g}% loss each way)"
        if self.mode == "oneway":
            return "one-way partitioned (nothing it sends reaches etcd)"
        return "partitioned (link down)"


def _fields(flag: str, text: str, allowed: tuple[str, ...], usage: str) -> dict[str, str]:
    """`k=v,k=v` -> dict, every key in `allowed` and node/step/seconds present; ValueError otherwise."""
    fields: dict[str, str] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in allowed:
            raise ValueError(f"{flag} {text!r}: expected {usage}")
        fields[key.strip()] = value.strip()
    missing = {"node", "step", "seconds"} - set(fields)
    if missing:
        raise ValueError(f"{flag} {text!r}: missing {', '.join(sorted(missing))}")
    return fields


def parse_partition(text: str) -> PartitionSpec:
    """`node=2,step=8,seconds=6[,mode=oneway]` -> PartitionSpec; ValueError naming the bad part."""
    fields = _fields("--partition", text, ("node", "step", "seconds", "mode"),
                     "node=N,step=S,seconds=D[,mode=down|oneway]")
    mode = fields.get("mode", "down")
    if mode not in ("down", "oneway"):
        raise ValueError(f"--partition {text!r}: mode must be down or oneway, got {mode!r}")
    try:
        return PartitionSpec(
            node=int(fields["node"]), step=int(fields["step"]), seconds=float(fields["seconds"]),
            mode="oneway" if mode == "oneway" else "down",
        )
    except ValueError as exc:
        raise ValueError(f"--partition {text!r}: {exc}") from None


def parse_sick_link(text: str) -> PartitionSpec:
    """`node=2,step=3,seconds=20,delay=50,loss=1` (`50ms`, `1%` accepted) -> a "sick" PartitionSpec."""
    fields = _fields("--sick-link", text, ("node", "step", "seconds", "delay", "loss"),
                     "node=N,step=S,seconds=D,delay=MS,loss=PERCENT")
    try:
        return PartitionSpec(
            node=int(fields["node"]), step=int(fields["step"]), seconds=float(fields["seconds"]), mode="sick",
            delay_ms=float(fields.get("delay", "0").removesuffix("ms")),
            loss=float(fields.get("loss", "0").removesuffix("%")),
        )
    except ValueError as exc:
        raise ValueError(f"--sick-link {text!r}: {exc}") from None


@dataclass
class PartitionRecord:
    """When a partition happened (Unix seconds), as written to <run_dir>/partitions.json."""

    node: int
    step: int
    down_at: float = 0.0
    """When the fault began (the link went down, the route or the relay was put in)."""
    up_at: float = 0.0
    """When the link was restored."""
    mode: str = "down"
    delay_ms: float = 0.0
    loss: float = 0.0


class Partitioner:
    """A thread that waits for each spec's step, applies its fault to the node's link, and restores it.

    `set_fault(spec, on)` does the work (launch.py maps it onto Topology): on=True applies the
    fault, on=False restores the link; `stop()` restores any fault still applied."""

    def __init__(
        self,
        specs: list[PartitionSpec],
        *,
        etcd: str,
        job: str,
        set_fault: Callable[[PartitionSpec, bool], None],
        say: Callable[[str], None],
    ) -> None:
        self.specs = sorted(specs, key=lambda s: s.step)
        self.etcd, self.rk = etcd, RunKeys(JobKeys(job))
        self.set_fault, self.say = set_fault, say
        self.records: list[PartitionRecord] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._applied: list[PartitionSpec] = []
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
            with waiting_for_steps(client, self.rk):  # the progress key at its short interval
                self._inject_all(client)
        except BaseException as exc:  # reported by the launcher after the run
            self.error = exc
        finally:
            client.close()

    def _inject_all(self, client: Any) -> None:
        """Each fault once its step is in flight, then its link restored after its seconds."""
        for spec in self.specs:
            while self._committed(client) < spec.step - 1:
                if self._stop.wait(0.05):
                    return
            record = PartitionRecord(node=spec.node, step=spec.step, down_at=time.time(), mode=spec.mode,
                                     delay_ms=spec.delay_ms, loss=spec.loss)
            self.set_fault(spec, True)
            self._applied.append(spec)
            self.records.append(record)
            self.say(f"netns: node {spec.node} {spec.describe()} during step {spec.step}")
            self._stop.wait(spec.seconds)
            self.set_fault(spec, False)
            self._applied.remove(spec)
            record.up_at = time.time()
            self.say(f"netns: node {spec.node} link restored after {record.up_at - record.down_at:.1f} s")

    def stop(self) -> None:
        """Stop waiting, restore any link still hurt, and join the thread."""
        self._stop.set()
        self._thread.join(timeout=10.0)
        for spec in list(self._applied):
            self.set_fault(spec, False)
            self._applied.remove(spec)

    def to_json(self) -> str:
        return json.dumps([asdict(r) for r in self.records], indent=1)
