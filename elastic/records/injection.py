"""Fault injections: `elastic run --inject` values, the etcd requests every injection becomes,
and the SIGSTOP/SIGCONT duty cycle of a slowed node.

`elastic run --inject` values (carried out like the operator's `elastic inject`, see below):

    kill:node=2,step=8        SIGKILL node 2's workers while step 8 (as printed, 1..K) is in flight
    kill:node=2,step=8,at=0.5 ... half-way through step 8: `at` x the duration of step 7 after
                              step 8 came in flight (0: at once; the same for hang)
    hang:node=2,step=8        SIGSTOP node 2's workers, then its agent (its lease expires)
    kill:node=3,when=reconfig SIGKILL node 3's workers as soon as the first reconfiguration begins
    rejoin:node=2,step=15     start a fresh agent (next incarnation) for the failed node 2

A step is "in flight" from the moment the previous step's commit is decided.

Every injection is an `InjectionRequest` under the job's `injections/<id>` key (the launcher
writes the `--inject` ones when the job starts, `elastic inject`/`elastic drain` write the
operator's). Who carries it out: the agent of the node's targeted incarnation for kill, hang,
slow and partition; the leader for drain; the launcher for rejoin (it spawns the next
incarnation). Whoever does writes an `InjectionStatus` under `injection-status/<id>`.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

from elastic.coordinator import schema
from elastic.coordinator.etcd_api import EtcdClient
from elastic.coordinator.jsonrecord import JsonRecord

Kind = Literal["kill", "hang", "rejoin"]
When = Literal["step", "reconfig"]
_KINDS: tuple[Kind, ...] = ("kill", "hang", "rejoin")


@dataclass(frozen=True, kw_only=True)
class Injection(JsonRecord):
    """One fault to inject (a part of the job's config, never a record of its own in etcd)."""

    kind: Kind
    """kill (SIGKILL the workers), hang (SIGSTOP workers and agent) or rejoin (fresh agent)."""
    node: int
    """Plan node it targets."""
    step: int | None = None
    """Step (1-based, as printed) during which it fires; None with when="reconfig"."""
    when: When = "step"
    """"step": while `step` is in flight; "reconfig": when the first reconfiguration begins."""
    at: float | None = None
    """With a step: fire this fraction of the previous step's duration after `step` came in
    flight (None or 0: at once)."""

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"unknown injection kind {self.kind!r}; use one of {', '.join(_KINDS)}")
        if self.node < 0:
            raise ValueError(f"injection node must be >= 0, got {self.node}")
        if self.when == "step":
            if self.step is None or self.step < 1:
                raise ValueError(f"{self.kind}: step must be given and >= 1 (steps are numbered from 1)")
        elif self.when == "reconfig":
            if self.kind == "rejoin":
                raise ValueError("rejoin cannot use when=reconfig; give step=N")
            if self.step is not None:
                raise ValueError("give either step=N or when=reconfig, not both")
        else:
            raise ValueError(f"injection when must be 'step' or 'reconfig', got {self.when!r}")
        if self.at is not None and (self.when != "step" or self.kind == "rejoin" or not 0.0 <= self.at <= 10.0):
            raise ValueError(f"{self.kind}: at must be a fraction in [0, 10] of a step, with step=N (got {self.at})")

    @property
    def name(self) -> str:
        """A stable key-safe name, e.g. `kill-node2-step8` (`kill-node2-step8-at0.5` with `at`)."""
        at = f"step{self.step}" if self.when == "step" else "reconfig"
        return f"{self.kind}-node{self.node}-{at}" + (f"-at{self.at:g}" if self.at else "")


def parse_injection(text: str) -> Injection:
    """Parse one `--inject` value (see the module doc); ValueError with the reason otherwise."""
    kind, sep, rest = text.partition(":")
    if not sep or kind not in _KINDS:
        raise ValueError(
            f"--inject {text!r}: expected KIND:key=value,... with KIND one of {', '.join(_KINDS)}"
        )
    fields: dict[str, str] = {}
    for part in rest.split(","):
        key, eq, value = part.partition("=")
        if not eq or not key or not value:
            raise ValueError(f"--inject {text!r}: {part!r} is not key=value")
        if key in fields:
            raise ValueError(f"--inject {text!r}: {key} given twice")
        fields[key] = value
    unknown = set(fields) - {"node", "step", "when", "at"}
    if unknown:
        raise ValueError(
            f"--inject {text!r}: unknown key(s) {', '.join(sorted(unknown))} (use node, step, when, at)"
        )
    if "node" not in fields:
        raise ValueError(f"--inject {text!r}: node=N is required")
    try:
        node = int(fields["node"])
        step = int(fields["step"]) if "step" in fields else None
    except ValueError:
        raise ValueError(f"--inject {text!r}: node and step must be integers") from None
    try:
        at = float(fields["at"]) if "at" in fields else None
    except ValueError:
        raise ValueError(f"--inject {text!r}: at must be a number (a fraction of a step)") from None
    when = fields.get("when", "step")
    if when not in ("step", "reconfig"):
        raise ValueError(f"--inject {text!r}: when must be 'reconfig' (or omitted), got {when!r}")
    try:
        return Injection(kind=kind, node=node, step=step, when=when, at=at)  # type: ignore[arg-type]
    except ValueError as exc:
        raise ValueError(f"--inject {text!r}: {exc}") from None


def check_injections(injections: list[Injection], *, nodes: int, steps: int) -> None:
    """ValueError if an injection names a node outside the run or a step past its end."""
    for inj in injections:
        if inj.node >= nodes:
            raise ValueError(f"--inject {inj.name}: node {inj.node} is not in the run (nodes 0..{nodes - 1})")
        if inj.step is not None and inj.step > steps:
            raise ValueError(f"--inject {inj.name}: step {inj.step} is past the last step {steps}")
    rejoined = {i.node for i in injections if i.kind == "rejoin"}
    failed = {i.node for i in injections if i.kind != "rejoin"}
    if rejoined - failed:
        raise ValueError(
            f"--inject rejoin of node(s) {sorted(rejoined - failed)} that no injection fails first"
        )


# ---- requests in etcd ----------------------------------------------------------------------

RequestKind = Literal["kill", "hang", "slow", "partition", "drain", "rejoin"]
REQUEST_KINDS: tuple[RequestKind, ...] = ("kill", "hang", "slow", "partition", "drain", "rejoin")
AGENT_KINDS: tuple[RequestKind, ...] = ("kill", "hang", "slow", "partition")
"""Kinds carried out by the targeted node's agent (drain: the leader; rejoin: the launcher)."""
RequestWhen = Literal["now", "step", "reconfig"]
State = Literal["running", "done", "refused", "fenced"]


@dataclass(frozen=True, kw_only=True)
class InjectionRequest(JsonRecord):
    """One fault (or drain, or rejoin) asked of a running job, stored at `injections/<id>`."""

    id: str
    """Key-safe request id; contains `-node<N>-` (the recovery breakdown finds a node's faults by it)."""
    kind: RequestKind
    """What to do (module doc)."""
    node: int
    """Plan node it targets."""
    incarnation: int | None
    """Incarnation of the node it targets (None for rejoin: the next one)."""
    when: RequestWhen = "now"
    """"now", "step" (while `step` is in flight) or "reconfig" (when the first reconfiguration begins)."""
    step: int | None = None
    """Step (1-based, as printed) for when="step"."""
    seconds: float | None = None
    """How long a slow or partition lasts."""
    steps: int | None = None
    """Slow, instead of `seconds`: it lasts while this many steps are in flight, from the one in
    flight when it begins."""
    factor: float | None = None
    """Slow: steps take about this many times longer (the workers run 1/factor of the time)."""
    at: float | None = None
    """With when="step": fire this fraction of the previous step's duration into `step`."""
    hold_cpu: bool = True
    """Slow: while the workers are stopped, a burner process per worker spins in their place
    (`Throttle`), so that simulated nodes sharing a host's cores do not run faster for it."""
    requested_at: float = 0.0
    """Wall time of the request."""
    by: str = "cli"
    """Who asked: "cli" (an operator), "config" (`elastic run --inject`), "sigterm" (a preempted
    node's agent asking for its own drain), or a test's name."""

    def __post_init__(self) -> None:
        if self.kind not in REQUEST_KINDS:
            raise ValueError(f"unknown request kind {self.kind!r}; use one of {', '.join(REQUEST_KINDS)}")
        if self.node < 0:
            raise ValueError(f"node must be >= 0, got {self.node}")
        if (self.when == "step") != (self.step is not None):
            raise ValueError("a step is given exactly when when='step'")
        if self.step is not None and self.step < 1:
            raise ValueError(f"step must be >= 1 (steps are numbered from 1), got {self.step}")
        if self.steps is not None and (self.kind != "slow" or self.steps < 1 or self.seconds is not None):
            raise ValueError(f"steps (>= 1, instead of seconds) apply to a slow request only, got {self.steps} "
                             f"for {self.kind} with seconds {self.seconds}")
        timed = self.kind == "partition" or (self.kind == "slow" and self.steps is None)
        if timed and (self.seconds is None or self.seconds <= 0):
            raise ValueError(f"{self.kind} needs seconds > 0, got {self.seconds}")
        if self.kind == "slow" and (self.factor is None or self.factor <= 1.0):
            raise ValueError(f"slow needs a factor > 1, got {self.factor}")
        if self.at is not None and (self.when != "step" or not 0.0 <= self.at <= 10.0):
            raise ValueError(f"at must be a fraction in [0, 10] of a step, with when='step' (got {self.at})")

    @classmethod
    def from_injection(cls, inj: Injection) -> InjectionRequest:
        """The request of one `--inject` value (targets incarnation 0; its id is `inj.name`)."""
        return cls(id=inj.name, kind=inj.kind, node=inj.node, incarnation=None if inj.kind == "rejoin" else 0,
                   when=inj.when, step=inj.step, at=inj.at, requested_at=time.time(), by="config")


def request_id(kind: str, node: int, step: int | None) -> str:
    """A fresh request id, e.g. `slow-node1-step5-3f2a9c` or `kill-node2-now-07be11`."""
    return f"{kind}-node{node}-{f'step{step}' if step is not None else 'now'}-{secrets.token_hex(3)}"


@dataclass(frozen=True, kw_only=True)
class InjectionStatus(JsonRecord):
    """What became of a request, at `injection-status/<id>` (rewritten as it progresses)."""

    state: State
    """running (a slow or partition under way), done, refused, or fenced (a healed partition found its node fenced)."""
    at: float
    """Wall time of this state."""
    step: int | None = None
    """Step (1-based) in flight when it was carried out, as far as the carrier knew."""
    generation: int | None = None
    """Drain: the generation without the node; fenced: the generation found after the heal."""
    detail: str = ""
    """Why it was refused, or what happened, in words."""


def submit_request(client: EtcdClient, root: str, request: InjectionRequest) -> None:
    """Write `request` under `<root>injections/<id>` (create-only: ValueError if the id exists)."""
    key = schema.key(root, "injections", request.id)
    txn = client.transactions
    ok, _ = client.transaction(compare=[txn.create(key) == 0], success=[txn.put(key, request.to_json())],
                               failure=[])
    if not ok:
        raise ValueError(f"injection request {request.id!r} already exists")


def read_requests(client: EtcdClient, root: str) -> list[InjectionRequest]:
    """Every request of the job, in id order."""
    return [InjectionRequest.from_json(v) for v, _ in client.get_prefix(schema.prefix(root, "injections"))]


def read_statuses(client: EtcdClient, root: str) -> dict[str, InjectionStatus]:
    """Request id -> its latest status, for the requests that have one."""
    prefix = schema.prefix(root, "injection-status")
    return {m.key.decode()[len(prefix) :]: InjectionStatus.from_json(v) for v, m in client.get_prefix(prefix)}


def read_status(client: EtcdClient, root: str, request_id: str) -> InjectionStatus | None:
    """The latest status of one request (one key read), None while it has none."""
    value, _ = client.get(schema.key(root, "injection-status", request_id))
    return None if value is None else InjectionStatus.from_json(value)


def write_status(client: EtcdClient, root: str, request_id: str, status: InjectionStatus) -> None:
    client.put(schema.key(root, "injection-status", request_id), status.to_json())


# ---- a slowed node: SIGSTOP/SIGCONT duty cycle -----------------------------------------------


_BURNER = (
    "import ctypes, os, sys\n"
    "parent = int(sys.argv[1])\n"
    "ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL: it dies with the thread that started it\n"
    "os.write(1, b'r')\n"
    "while os.getppid() == parent:\n"
    "    pass\n"
)
"""A process that spins until its parent is gone (Linux; a stopped one is killed with it too)."""


def process_state(pid: int) -> str | None:
    """The state letter of a process in /proc/<pid>/stat (R running, S sleeping, T stopped, Z
    zombie, ...); None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data[data.rindex(b")") + 2 :].split()[0].decode()


def _stat(pid: int) -> tuple[str, float] | None:
    """(state letter, CPU seconds of its main thread) of a process, from /proc; None when gone.
    The main thread is where a worker computes; its schedstat counts nanoseconds (the process's
    stat counts 10 ms ticks, too coarse to compare processes tick by tick)."""
    state = process_state(pid)
    if state is None:
        return None
    try:
        with open(f"/proc/{pid}/schedstat", "rb") as f:
            ran_ns = int(f.read().split()[0])
    except (OSError, IndexError, ValueError):
        return None
    return state, ran_ns / 1e9


_TICK_S = 0.005
"""How often the CPU-proportional throttle reads its processes' CPU time."""
_LEAST_REPAY_S = 0.001
"""A repayment stops once less than this is left of it."""
_LEAST_PAUSE_S = 0.01
"""Stop debt below this waits for a later tick: fewer, longer pauses, each of which costs two
rounds of signals."""


class Throttle:
    """Slow processes down with real signals, for `seconds` (or until `stop` is set or `until()`
    holds). `lock` is held while signals are sent and `active` changes, so a hang detector that
    checks under the same lock and skips while `active` never takes the throttling for a hang.

    Two ways, by `hold_cpu`:

    - **CPU-proportional, holding the cores** (`hold_cpu`, what `elastic inject slow` does by
      default): every 5 ms the processes' CPU time is read (their main threads', /proc); each
      CPU second the busiest of them used becomes `factor - 1` seconds stopped (all of them
      together; CPU seconds of their burners, see below, so that on less than a core the stop
      stretches as their computation did), taken while a main thread is running (not while it is blocked on a peer, when
      a stop would cost nothing). So their computation takes
      `factor` times as long and their waiting does not, as on a device `factor` times slower.
      While they are stopped, one burner process per throttled process spins in its place (its
      own SIGSTOP/SIGCONT, in antiphase), so they keep the same share of the host's cores: on a
      host that runs several simulated nodes on fewer cores, the other nodes would otherwise run
      faster for it.
    - **a duty cycle** (without `hold_cpu`): each `period` (50 ms) they run `period / factor`
      seconds and stay stopped the rest, whatever they were doing. A process that spends much of
      a step waiting on peers is slowed less than `factor`, and its host's other processes take
      its share of the cores (a throttle of 2 on one of 4 simulated nodes on 2 cores slowed a job
      of 2 two-stage pipelines to 0.70x). It suits a process whose work is not on the host CPU.
    """

    def __init__(self, pids: Iterable[int], *, factor: float, seconds: float, lock: threading.Lock,
                 period: float = 0.05, hold_cpu: bool = False, cgroup: str = "") -> None:
        if factor <= 1.0:
            raise ValueError(f"factor must be > 1, got {factor}")
        self.pids = list(pids)
        self.cgroup = cgroup
        """The cgroup the processes are in (`elastic run --node-cpus`), which each burner joins ("": none)."""
        self.factor, self.seconds, self.period = factor, seconds, period
        self.lock = lock
        self.hold_cpu = hold_cpu
        self.burners: list[subprocess.Popen[bytes]] = []
        self.active = False
        self.stopped_s = 0.0

    def _signal(self, sig: signal.Signals) -> None:
        """`sig` to each process, and the other one to its burner: the one that stops first, so
        that the two never run at once."""
        anti = signal.SIGCONT if sig == signal.SIGSTOP else signal.SIGSTOP
        for i, pid in enumerate(self.pids):
            burner = self.burners[i] if i < len(self.burners) else None
            if burner is not None and burner.returncode is not None:
                burner = None
            if burner is not None and anti == signal.SIGSTOP:
                burner.send_signal(anti)
            try:
                os.kill(pid, sig)
            except ProcessLookupError:  # gone (a drained node's worker): its burner stops with it
                self._end_burner(i)
                continue
            if burner is not None and anti == signal.SIGCONT:
                burner.send_signal(anti)

    def _start_burners(self) -> None:
        for _ in self.pids:
            burner = subprocess.Popen([sys.executable, "-S", "-c", _BURNER, str(os.getpid())],
                                      stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
            assert burner.stdout is not None
            burner.stdout.read(1)  # its death signal is set: stopped from now on, it still dies with us
            burner.stdout.close()
            burner.send_signal(signal.SIGSTOP)
            if self.cgroup:  # it spins in their place: in their CPU quota too
                with open(os.path.join(self.cgroup, "cgroup.procs"), "w") as procs:
                    procs.write(str(burner.pid))
            self.burners.append(burner)

    def _end_burner(self, i: int) -> None:
        """Stop the burner of the `i`th process (if it has one still running)."""
        burner = self.burners[i] if i < len(self.burners) else None
        if burner is not None and burner.returncode is None:
            burner.kill()
            burner.wait()

    @contextlib.contextmanager
    def _stopped(self) -> Iterator[None]:
        """The processes stopped (and their burners running) while inside; the time counted in `stopped_s`."""
        with self.lock:
            self.active = True
            self._signal(signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            yield
        finally:
            with self.lock:
                self._signal(signal.SIGCONT)
                self.active = False
            self.stopped_s += time.monotonic() - t0

    def _pause(self, stop: threading.Event, seconds: float) -> None:
        """Stop the processes (and run the burners) for `seconds`, or until `stop` is set."""
        with self._stopped():
            stop.wait(seconds)

    def _duty_cycle(self, stop: threading.Event, end: float, until: Callable[[], bool] | None) -> None:
        run_s = self.period / self.factor
        while time.monotonic() < end and not (until is not None and until()) and not stop.wait(run_s):
            self._pause(stop, min(self.period - run_s, max(0.0, end - time.monotonic())))

    def _proportional(self, stop: threading.Event, end: float, until: Callable[[], bool] | None) -> None:
        def cpu_and_running() -> tuple[dict[int, float], bool]:
            cpu, running = {}, False
            for i, pid in enumerate(self.pids):
                st = _stat(pid)
                if st is None or st[0] in "ZX":  # gone: its burner stops with it
                    self._end_burner(i)
                else:
                    cpu[pid], running = st[1], running or st[0] == "R"
            return cpu, running

        used, _ = cpu_and_running()
        debt = 0.0
        while time.monotonic() < end and not (until is not None and until()) and not stop.wait(_TICK_S):
            now, running = cpu_and_running()
            # The processes compute side by side (one device each): the busiest one's CPU time is
            # the node's, and all of them are stopped together.
            debt += max((c - used.get(pid, c) for pid, c in now.items()), default=0.0) * (self.factor - 1.0)
            used = now
            if debt >= _LEAST_PAUSE_S and running:
                self._repay(stop, debt, end)
                debt = 0.0

    def _repay(self, stop: threading.Event, debt: float, end: float) -> None:
        """Stop the processes until their burners have spun `debt` CPU seconds (the busiest of them),
        or `end`. In CPU time, not wall time: where the node gets less than a core (a cgroup quota,
        a busy host), its computation took longer than its CPU time, and so does the repayment."""
        start = {b.pid: st[1] for b in self.burners if b.returncode is None and (st := _stat(b.pid)) is not None}
        if not start:  # every burner is gone with its process: nothing left to slow
            return
        with self._stopped():
            while (left := debt - max((st[1] - c for pid, c in start.items() if (st := _stat(pid)) is not None),
                                      default=debt)) > _LEAST_REPAY_S:
                if stop.wait(min(left, max(0.0, end - time.monotonic()))) or time.monotonic() >= end:
                    break

    def _stop_burners(self) -> None:
        for i in range(len(self.burners)):
            self._end_burner(i)
        self.burners.clear()

    def run(self, stop: threading.Event, *, until: Callable[[], bool] | None = None) -> None:
        """Throttle until `seconds` have passed, `until()` holds (asked every few ms) or `stop`
        is set; the processes run on afterwards."""
        end = time.monotonic() + self.seconds
        try:
            if self.hold_cpu:
                self._start_burners()
                self._proportional(stop, end, until)
            else:
                self._duty_cycle(stop, end, until)
        finally:
            with self.lock:
                self._signal(signal.SIGCONT)
                self.active = False
            self._stop_burners()
