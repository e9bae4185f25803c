"""A failure trace at Llama 3's failure rate and causes: `llama3[,seed=S][,repair=24h][,restart=2m]`.

The facts (Dubey et al., "The Llama 3 Herd of Models", 2024, section 3.3.4 and Table 5):
during a 54-day snapshot of pre-training on 16,384 H100 GPUs there were 466 job interruptions,
47 planned and 419 unexpected; about 78% of the unexpected ones were confirmed or suspected
hardware issues. Table 5 counts the 419 unexpected ones by cause (`TABLE5`); the counts are
the weights of the causes drawn here (the table's percentage column is not used).

The model (our assumptions, stated with the results):

- Only the 419 unexpected interruptions are drawn: the 47 planned ones (maintenance the job
  schedules) are left out.
- Each node fails as a Poisson process at 419 / (54 days x 16,384 GPUs) per GPU times its G
  GPUs, while it is up: the cluster draws candidate failures at rate N x G x that rate, each
  for a node drawn uniformly from all N, and a candidate on a node that is down is dropped
  (thinning). A failure that would take the last live node is dropped too.
- Each failure's cause is drawn with Table 5's counts as weights, and the cause sets its
  effect: `process` (software bug, NCCL watchdog timeouts, dependency: the node's processes
  die and the host stays up) brings the node back `restart` later (default 2 min: relaunching
  the node's processes on a GPU host, an assumption; bench/README.md "Start-up" measured a
  rejoin in 0.76-4.0 s on CPU with a tiny model, a lower bound); every other cause is `node`
  (the host is lost: faulty GPU, memory, network, host maintenance, ...), back `repair` later
  (default 24 h, an assumption: the paper gives no repair time).
- Every event keeps its cause (`TraceEvent.cause`), so the report counts failures per cause.
- One PRNG, `random.Random(f"llama3:{seed}")`: the same seed gives the same trace.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass

from elastic.sim.trace import Trace, TraceError, TraceEvent, parse_duration

NAME = "llama3"
"""The first item of the spec."""
SPEC_KEYS = ("seed", "repair", "restart")
DAYS = 54
"""Length of the paper's snapshot."""
GPUS = 16_384
"""GPUs of the paper's job."""
TABLE5: tuple[tuple[str, int], ...] = (
    ("Faulty GPU", 148),
    ("GPU HBM3 memory", 72),
    ("Software bug", 54),
    ("Network switch/cable", 35),
    ("Host maintenance", 32),
    ("GPU SRAM memory", 19),
    ("GPU system processor", 17),
    ("NIC", 7),
    ("NCCL watchdog timeouts", 7),
    ("Silent data corruption", 6),
    ("GPU thermal interface + sensor", 6),
    ("SSD", 3),
    ("Power supply", 3),
    ("Server chassis", 2),
    ("IO expansion board", 2),
    ("Dependency", 2),
    ("CPU", 2),
    ("System memory", 2),
)
"""Unexpected interruptions by cause during the 54 days (Table 5); they sum to 419."""
UNEXPECTED = sum(count for _, count in TABLE5)
PROCESS_CAUSES = frozenset({"Software bug", "NCCL watchdog timeouts", "Dependency"})
"""Causes whose effect is `process`: the node's processes die, the host stays up."""
RATE_PER_GPU_S = UNEXPECTED / (DAYS * 86_400.0 * GPUS)
"""Unexpected interruptions per GPU-second."""
DEFAULT_REPAIR_S = 24 * 3600.0
DEFAULT_RESTART_S = 120.0


def effect_of(cause: str) -> str:
    """'process' (the node's processes are lost) or 'node' (the host is lost) for a Table 5 cause."""
    return "process" if cause in PROCESS_CAUSES else "node"


@dataclass(frozen=True, kw_only=True)
class Llama3Spec:
    """The keys of a `llama3` trace spec."""

    seed: int = 0
    """Seeds the trace's PRNG."""
    repair_s: float = DEFAULT_REPAIR_S
    """A node lost to a `node` cause joins again this long after its failure."""
    restart_s: float = DEFAULT_RESTART_S
    """A node lost to a `process` cause joins again this long after its failure."""

    def describe(self) -> str:
        return (f"llama3 seed={self.seed} repair={self.repair_s:g}s restart={self.restart_s:g}s "
                f"(Llama 3 Table 5: {UNEXPECTED} unexpected interruptions / {DAYS} days / {GPUS} GPUs)")


def is_llama3(spec: str) -> bool:
    """Whether `spec` is a `llama3` trace spec."""
    return spec.split(",", 1)[0].strip() == NAME


def parse_llama3(spec: str) -> Llama3Spec:
    """The keys of `spec` (`llama3[,seed=S][,repair=D][,restart=D]`); TraceError names a bad key."""
    items = [part.strip() for part in spec.split(",")]
    if items[0] != NAME:
        raise TraceError(f"a llama3 trace spec starts with {NAME!r}, got {spec!r}")
    fields: dict[str, str] = {}
    for part in items[1:]:
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in SPEC_KEYS:
            raise TraceError(f"bad llama3 trace spec item {part!r} in {spec!r}: expected "
                             "llama3[,seed=S][,repair=24h][,restart=2m]")
        if key in fields:
            raise TraceError(f"trace spec {spec!r} gives {key} twice")
        fields[key] = value.strip()
    try:
        seed = int(fields.get("seed", "0"))
    except ValueError:
        raise TraceError(f"trace spec seed must be an integer, got {fields['seed']!r}") from None
    return Llama3Spec(seed=seed, repair_s=_delay(fields, "repair", DEFAULT_REPAIR_S),
                      restart_s=_delay(fields, "restart", DEFAULT_RESTART_S))


def _delay(fields: dict[str, str], key: str, default: float) -> float:
    if key not in fields:
        return default
    try:
        value = parse_duration(fields[key])
    except TraceError as exc:
        raise TraceError(f"trace spec {key}: {exc}") from None
    if not value > 0:
        raise TraceError(f"trace spec {key} must be > 0, got {fields[key]!r}")
    return value


def llama3_trace(spec: str, *, initial_nodes: int, gpus_per_node: int, horizon_s: float) -> Trace:
    """The trace of `spec` over [0, horizon_s] for `initial_nodes` nodes of `gpus_per_node` GPUs."""
    keys = parse_llama3(spec)
    if initial_nodes < 1 or gpus_per_node < 1:
        raise TraceError(f"a llama3 trace needs >= 1 node and >= 1 GPU a node, got {initial_nodes} x {gpus_per_node}")
    events = _draw(keys, nodes=initial_nodes, rate_s=RATE_PER_GPU_S * initial_nodes * gpus_per_node,
                   horizon_s=horizon_s)
    return Trace(initial_nodes=initial_nodes, events=tuple(events), description=keys.describe())


def _draw(keys: Llama3Spec, *, nodes: int, rate_s: float, horizon_s: float) -> list[TraceEvent]:
    """Fail events (with causes) and the joins they bring, in time order (module docstring)."""
    rng = random.Random(f"{NAME}:{keys.seed}")
    causes = [cause for cause, _ in TABLE5]
    weights = [count for _, count in TABLE5]
    down: set[int] = set()
    returns: list[tuple[float, int]] = []  # (join time, node), a heap
    events: list[TraceEvent] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate_s)
        while returns and returns[0][0] <= min(t, horizon_s):
            when, node = heapq.heappop(returns)
            down.discard(node)
            events.append(TraceEvent(time_s=when, event="join", node=node))
        if t > horizon_s or not math.isfinite(t):
            return events
        node = rng.randrange(nodes)
        cause = rng.choices(causes, weights)[0]
        if node in down or len(down) == nodes - 1:
            continue  # thinned: the node is down already, or it is the last one up
        down.add(node)
        events.append(TraceEvent(time_s=t, event="fail", node=node, cause=cause))
        delay = keys.restart_s if effect_of(cause) == "process" else keys.repair_s
        heapq.heappush(returns, (t + delay, node))
