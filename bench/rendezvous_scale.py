"""Issue 13 part 2: seconds for a generation's group rendezvous at W simulated ranks, on a real etcd.

    .venv/bin/python bench/rendezvous_scale.py --world 8 64 256 1024 [--pattern lazy eager nccl] [--repeats 3]
        [--procs P] [--ranks-per-client N] [--ranks-per-relay 8]

Each simulated rank is a thread holding its own `EtcdStore` (the project's real store) seen
through the same `PrefixStore(group_prefix(g, None), store)` that `build_groups` hands to the
world group, so every call crosses torch's C++ -> Python store trampoline as gloo's do. There is
no gloo mesh and no model: each rank replays the store calls that a gloo world group of W ranks
makes, as logged from `ProcessGroupGloo` on torch 2.13 (a logging store under 4 and 8 real ranks):

- `eager` (the default construction): `set(<dev>/<rank>, address)`, then for every rank i,
  itself included, in order: `wait([<dev>/<i>])`, `get(<dev>/<i>)`. W sets and 2 W^2 reads in
  all, whatever the store: a full mesh needs every rank to read every other rank's address.
- `lazy` (`TORCH_GLOO_LAZY_INIT=1`): the construction makes one `set`; each peer a rank first
  talks to costs a `wait` + `get` of its key. The pattern is the construction plus the first ring
  all-reduce over the world group (peers rank+1 and rank-1), W sets and 4 W reads in all.
- `nccl`: NCCL's unique-id exchange through the store, as `ProcessGroupNCCL` makes it when a
  communicator is created (lazily, at its first collective): rank 0 `set`s the 128-byte
  `ncclUniqueId` under the group's key, every other rank `get`s it (a blocking get: `wait` then
  read). One set and W - 1 blocking reads; NCCL's own bootstrap then runs over the network, not
  the store, and is not simulated. (torch's multi-root initialisation, `ncclCommInitRankScalable`,
  sets one id per root and is not this pattern.)

How the ranks are spread: `--procs P` (default 1) splits the W ranks into P contiguous blocks
(ranks [p W / P, (p + 1) W / P) in process p), one OS process each, so P GILs decode gRPC replies
in parallel instead of one. P = 1 runs the ranks as threads of this process (the figures before
`--procs` existed); P > 1 starts P children of this file (`--child`, a JSON line protocol on their
stdin/stdout), all on the same job id and generation, so they meet in the same keys. Every process
opens its own etcd clients: one for all its ranks by default (`--ranks-per-client 0`), or one per N
ranks (`--ranks-per-client 8`: one per node of 8 GPUs), or one a rank (`--ranks-per-client 1`),
as a real job has (a client per worker process): etcd then serves a connection, and a Watch stream
for each rank that waited, per rank. A wait watches only its missing keys (`store_waits.py`; a
client with many waits open shares a watch of the prefix for the rest), so a put reaches only the
clients waiting on its key, whatever the number of clients; the watch events etcd sent are printed
beside the requests (`events/rank`, etcd's `etcd_debugging_mvcc_events_total`).

`--ranks-per-relay 8` gives every node of 8 ranks the store relay its agent runs
(`elastic/coordinator/store_relay.py`, one etcd client and one thread each): the node's sets and
reads go to etcd as shared transactions, and only a wait's watch is the rank's own.

Printed for each rendezvous: its seconds; etcd's CPU seconds for it with the rank processes'
set-up (`etcd core-s`) and without (`in it`: from the release to the last rank's finish, what
etcd would spend with the ranks on hosts of their own); etcd requests a rank, by method; and the
watch events etcd sent, a rank.

Timing: with P = 1 a rendezvous is timed from the release of all W threads (a barrier) until the
last one is done. With P > 1 every child builds its stores and parks its threads on a barrier, says
it is ready, and the parent sends all of them one release time a little ahead (`time.time()`); each
child releases its threads then and reports its last rank's finish (`time.time()`), and the figure
is max(finish) - release. etcd requests come from etcd's own /metrics (`grpc_server_started_total`,
every method), read before the first release and after the last rendezvous, so the figure is what
etcd served, not what the clients believe they sent.

What this is not: W hosts. Every figure runs etcd and all P processes on the one machine (two cores
on the reference machine): etcd, the client-side work of W ranks (gRPC calls, protobuf decoding)
and the thread switching share those cores, where real workers have a host each. More processes
than cores lift the GIL, not the CPU limit; the seconds here overstate what W processes on W hosts
would see. One Python thread stands for each rank: W threads over the P processes, which the
kernel's pid_max (32,768 on the reference machine) and the user's thread limit must allow. A rank
process holds about 310 MiB resident (torch imported) at up to 1,024 ranks, and starts in a few
seconds (outside the timed rendezvous).
"""

# No `from __future__ import annotations`: bench/control_plane_scale.py loads this file without
# putting it in sys.modules, where `dataclass` cannot resolve string annotations.

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import IO, Any

import psutil
import torch.distributed as dist

from elastic.coordinator import EtcdConfig, EtcdServer, EtcdStore, JobKeys, connect
from elastic.coordinator.store_relay import LINGER_S, StoreRelay, StoreRelayClient
from elastic.parallel.groups import group_prefix

PATTERNS = ("eager", "lazy", "nccl")
_ADDRESS = "x" * 154  # a gloo tcp address record measured on torch 2.13 is 154-186 bytes
_UNIQUE_ID = "\x02" * 128  # sizeof(ncclUniqueId): 128 bytes once encoded
_METRIC = re.compile(r'^grpc_server_started_total\{[^}]*grpc_method="(\w+)"[^}]*\} (\S+)', re.M)
EVENTS = "events"
"""`etcd_requests`' entry for the watch events etcd sent (not a request: kept apart in the figures)."""
_EVENTS = re.compile(r"^etcd_debugging_mvcc_events_total (\S+)", re.M)
_STORE_TIMEOUT = timedelta(seconds=120)
_RELEASE_AHEAD_S = 0.25
"""How far ahead of now the parent sets the release time of P > 1 processes (one pipe write each)."""


@dataclass(frozen=True, kw_only=True)
class Part:
    """The simulated ranks one process runs, and where and how they meet."""

    endpoint: str
    """The etcd every rank talks to."""
    job: str
    """The job id: every process of a rendezvous uses the same one, so the keys are the same."""
    world: int
    """Ranks in the whole group, over all processes."""
    pattern: str
    """One of PATTERNS (module doc)."""
    first: int
    """The first world rank of this process."""
    last: int
    """One past the last world rank of this process."""
    ranks_per_client: int = 0
    """Ranks sharing one etcd client; 0: one client for all ranks of the process."""
    ranks_per_relay: int = 0
    """Ranks a node's store relay serves (8: a node of 8 GPUs), each relay with an etcd client of
    its own, as an agent has; 0: no relay, every rank's requests direct."""
    relay_linger_s: float = LINGER_S
    """How long a relay's batch waits for more requests (`StoreRelay`'s `linger_s`)."""
    lockstep: int = 0
    """Ranks of a node (that many consecutive ranks) that pass a barrier of their own before each
    store call, so that they call together, as a node's processes on their own cores do; 0: every
    rank runs free (lazy and eager only: NCCL's rank 0 makes fewer calls than the others)."""


def etcd_requests(endpoint: str) -> dict[str, int]:
    """gRPC requests etcd has started since it came up, by method (Range, Put, Txn, Watch, ...),
    and under `EVENTS` the watch events it has sent."""
    text = urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10).read().decode()
    counts: dict[str, int] = {}
    for method, n in _METRIC.findall(text):
        counts[method] = counts.get(method, 0) + int(float(n))
    counts[EVENTS] = sum(int(float(n)) for n in _EVENTS.findall(text))  # 1.2e+06 past a million
    return counts


def generation_prefix(job: str, generation: int) -> str:
    """The etcd prefix of generation `generation`'s store, as the runtime names it."""
    return JobKeys(job).store(f"gen-{generation}")


def _rank_calls(store: dist.Store, rank: int, world: int, pattern: str,
                together: Callable[[], object] = lambda: None) -> None:
    """The store calls world rank `rank` makes while its gloo world group of `world` connects
    (`together()` before each, lazy and eager only: `Part.lockstep`)."""
    if pattern == "nccl":
        if rank == 0:
            store.set("0/unique-id", _UNIQUE_ID)
        else:
            store.wait(["0/unique-id"], _STORE_TIMEOUT)
            store.get("0/unique-id")
        return
    together()
    store.set(f"0/{rank}", _ADDRESS)
    peers = range(world) if pattern == "eager" else sorted({(rank + 1) % world, (rank - 1) % world})
    for peer in peers:
        together()
        store.wait([f"0/{peer}"], _STORE_TIMEOUT)
        store.get(f"0/{peer}")


class _Ranks:
    """One generation's simulated ranks of one process: a store and a thread each, the threads
    parked on a barrier until `release()`."""

    def __init__(self, part: Part, clients: list[Any], generation: int, relays: list[StoreRelay]) -> None:
        n = part.last - part.first
        per = part.ranks_per_client or n
        prefix = generation_prefix(part.job, generation)
        node0 = part.first // part.ranks_per_relay if part.ranks_per_relay else 0
        self.relayed = [StoreRelayClient(relays[(part.first + i) // part.ranks_per_relay - node0].name)
                        if relays else None for i in range(n)]
        self.stores = [EtcdStore(clients[i // per], prefix, timeout=_STORE_TIMEOUT, relay=self.relayed[i])
                       for i in range(n)]
        prefixed = [dist.PrefixStore(group_prefix(generation, None), s) for s in self.stores]
        self.start = threading.Barrier(n + 1)
        self.errors: list[BaseException] = []
        self.finished: list[float] = []
        nodes: dict[int, threading.Barrier] = {}
        if part.lockstep:
            for rank in range(part.first, part.last):
                node = rank // part.lockstep
                if node not in nodes:
                    nodes[node] = threading.Barrier(min(part.last, (node + 1) * part.lockstep) - rank)

        def rank_main(i: int) -> None:
            self.start.wait()
            node = nodes.get((part.first + i) // part.lockstep) if part.lockstep else None
            try:
                _rank_calls(prefixed[i], part.first + i, part.world, part.pattern,
                            node.wait if node is not None else lambda: None)
                self.finished.append(time.time())
            except BaseException as exc:  # reported by join()
                self.errors.append(exc)

        self.threads = [threading.Thread(target=rank_main, args=(i,), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def release(self) -> None:
        self.start.wait()

    def join(self) -> float:
        """The wall time (`time.time()`) the last rank finished; raises if any rank failed."""
        for t in self.threads:
            t.join()
        for s in self.stores:
            s.release()
        for r in self.relayed:
            if r is not None:
                r.close()
        if self.errors:
            raise RuntimeError(f"{len(self.errors)} of {len(self.threads)} simulated ranks failed: "
                               f"{self.errors[0]!r}")
        return max(self.finished)


def _clients(part: Part) -> list[Any]:
    """The etcd clients of one process's ranks (`Part.ranks_per_client`)."""
    n = part.last - part.first
    per = part.ranks_per_client or n
    return [connect(EtcdConfig(endpoint=part.endpoint, timeout=60.0)) for _ in range(0, n, per)]


def _relays(part: Part) -> list[StoreRelay]:
    """The store relays of the nodes of one process's ranks (`Part.ranks_per_relay`), each with
    an etcd client of its own."""
    if not part.ranks_per_relay:
        return []
    nodes = range(part.first // part.ranks_per_relay, (part.last - 1) // part.ranks_per_relay + 1)
    return [StoreRelay(connect(EtcdConfig(endpoint=part.endpoint, timeout=60.0)),
                       name=f"bench-store-{part.job}-{node}", timeout_s=60.0, linger_s=part.relay_linger_s)
            for node in nodes]


def _close_relays(relays: list[StoreRelay]) -> None:
    for relay in relays:
        relay.close()
        relay.client.close()


class _InProcess:
    """All ranks as threads of this process (P = 1): the seconds from the release to the last."""

    def __init__(self, part: Part) -> None:
        self.part, self.clients, self.relays = part, _clients(part), _relays(part)
        self.ranks: _Ranks | None = None

    def build(self, generation: int) -> None:
        self.ranks = _Ranks(self.part, self.clients, generation, self.relays)

    def run(self) -> float:
        assert self.ranks is not None, "build() first"
        self.ranks.release()
        t0 = time.perf_counter()
        self.ranks.join()
        return time.perf_counter() - t0

    def close(self) -> None:
        _close_relays(self.relays)
        for c in self.clients:
            c.close()


class _Processes:
    """The ranks spread over child processes (P > 1): max(finish) - release over all of them."""

    def __init__(self, parts: list[Part]) -> None:
        self.children = [
            subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", json.dumps(asdict(p))],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
            for p in parts
        ]

    def _ask_all(self, message: dict[str, Any]) -> list[dict[str, Any]]:
        """Send `message` to every child, then read one answer from each."""
        for child in self.children:
            assert child.stdin is not None
            child.stdin.write(json.dumps(message) + "\n")
            child.stdin.flush()
        answers = []
        for i, child in enumerate(self.children):
            assert child.stdout is not None
            line = child.stdout.readline()
            if not line:
                raise RuntimeError(f"rank process {i} exited (code {child.wait()}) before answering {message}")
            answer = json.loads(line)
            if answer.get("error"):
                raise RuntimeError(f"rank process {i}: {answer['error']}")
            answers.append(answer)
        return answers

    def build(self, generation: int) -> None:
        self._ask_all({"build": generation})

    def run(self) -> float:
        release = time.time() + _RELEASE_AHEAD_S
        answers = self._ask_all({"go": release})
        return max(a["finished"] for a in answers) - release

    def close(self) -> None:
        for child in self.children:
            if child.stdin is not None:
                child.stdin.close()  # EOF: the child closes its clients and exits
        for child in self.children:
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


def _child(part: Part, commands: IO[str], answers: IO[str]) -> None:
    """A rank process: `{"build": g}` -> `{"ready": g}` once its threads are parked,
    `{"go": t}` -> `{"finished": last}` after releasing them at wall time t; EOF ends it."""
    clients, relays = _clients(part), _relays(part)
    ranks: _Ranks | None = None
    try:
        for line in commands:
            message = json.loads(line)
            try:
                if "build" in message:
                    ranks = _Ranks(part, clients, int(message["build"]), relays)
                    answer: dict[str, Any] = {"ready": message["build"]}
                else:
                    assert ranks is not None, "go before build"
                    time.sleep(max(0.0, float(message["go"]) - time.time()))
                    ranks.release()
                    answer = {"finished": ranks.join()}
            except Exception as exc:  # the parent raises it
                answer = {"error": repr(exc)}
            answers.write(json.dumps(answer) + "\n")
            answers.flush()
    finally:
        _close_relays(relays)
        for c in clients:
            c.close()


def _parts(endpoint: str, job: str, world: int, pattern: str, procs: int, ranks_per_client: int,
           ranks_per_relay: int, relay_linger_s: float, lockstep: int) -> list[Part]:
    """`procs` contiguous blocks of the `world` ranks."""
    return [
        Part(endpoint=endpoint, job=job, world=world, pattern=pattern, first=p * world // procs,
             last=(p + 1) * world // procs, ranks_per_client=ranks_per_client, ranks_per_relay=ranks_per_relay,
             relay_linger_s=relay_linger_s, lockstep=lockstep)
        for p in range(procs)
    ]


def rendezvous_seconds(
    endpoint: str, world: int, *, repeats: int = 1, pattern: str = "lazy", procs: int = 1,
    ranks_per_client: int = 0, ranks_per_relay: int = 0, relay_linger_s: float = LINGER_S, lockstep: int = 0,
    etcd_pid: int | None = None,
) -> dict[str, Any]:
    """Time `repeats` generation rendezvous of `world` simulated ranks on the etcd at `endpoint`,
    spread over `procs` processes (module doc), `ranks_per_client` ranks to an etcd client (0:
    one client a process), `ranks_per_relay` ranks to a node's store relay (0: none).

    Returns `seconds` (median over repeats), `seconds_all`, `requests_per_rank` (etcd requests
    of all methods per rank and rendezvous, from etcd's /metrics), `requests_by_method` (per
    rendezvous), `events_per_rank` (watch events etcd sent, per rank and rendezvous), with
    `etcd_pid` (an etcd of this machine) `etcd_core_s`, etcd's CPU seconds while the ranks
    rendezvoused (median over repeats; their processes' start and clients' connections left out),
    and the `world`, `pattern`, `repeats` and `procs` it ran with. `pattern` is `lazy`
    (a gloo world group with TORCH_GLOO_LAZY_INIT=1 and its first ring all-reduce), `eager` (the
    full-mesh construction) or `nccl` (NCCL's unique-id exchange); see the module doc.
    """
    if pattern not in PATTERNS:
        raise ValueError(f"pattern must be one of {PATTERNS}, got {pattern!r}")
    if world < 1 or repeats < 1:
        raise ValueError(f"world and repeats must be >= 1, got {world} and {repeats}")
    if not 1 <= procs <= world or ranks_per_client < 0 or ranks_per_relay < 0:
        raise ValueError(f"procs must be in [1, world], ranks_per_client and ranks_per_relay >= 0, got {procs}, "
                         f"{ranks_per_client} and {ranks_per_relay}")
    job = f"rdzv-bench-{uuid.uuid4().hex[:8]}"
    if lockstep < 0 or (lockstep and pattern == "nccl"):
        raise ValueError(f"lockstep must be >= 0, and 0 with the nccl pattern, got {lockstep} with {pattern}")
    parts = _parts(endpoint, job, world, pattern, procs, ranks_per_client, ranks_per_relay, relay_linger_s,
                   lockstep)
    client = connect(EtcdConfig(endpoint=endpoint, timeout=60.0))  # drops the keys afterwards
    sim = _InProcess(parts[0]) if procs == 1 else _Processes(parts)
    times: list[float] = []
    etcd = psutil.Process(etcd_pid) if etcd_pid is not None else None
    core_s: list[float] = []
    try:
        sim.build(1)
        before = etcd_requests(endpoint)
        for g in range(1, repeats + 1):
            if g > 1:
                sim.build(g)
            cpu0 = sum(etcd.cpu_times()[:2]) if etcd is not None else 0.0
            times.append(sim.run())
            if etcd is not None:
                core_s.append(sum(etcd.cpu_times()[:2]) - cpu0)
        after = etcd_requests(endpoint)
    finally:
        sim.close()
        for g in range(1, repeats + 1):
            client.delete_prefix(generation_prefix(job, g))
        client.close()
    by_method = {m: (after.get(m, 0) - before.get(m, 0)) / repeats for m in after}
    events = by_method.pop(EVENTS, 0.0)
    by_method = {m: n for m, n in by_method.items() if n}
    total = sum(by_method.values())
    return {
        "world": world,
        "pattern": pattern,
        "repeats": repeats,
        "procs": procs,
        "ranks_per_relay": ranks_per_relay,
        "relay_linger_s": relay_linger_s,
        "lockstep": lockstep,
        "seconds": sorted(times)[len(times) // 2],
        "seconds_all": [round(t, 4) for t in times],
        "requests_per_rank": total / world,
        "requests_by_method": by_method,
        "events_per_rank": events / world,
        "etcd_core_s": sorted(core_s)[len(core_s) // 2] if core_s else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world", type=int, nargs="+", default=[8, 64, 256, 1024])
    parser.add_argument("--pattern", choices=PATTERNS, nargs="+", default=["lazy"])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--procs", type=int, nargs="+", default=[1], help="processes the ranks are spread over")
    parser.add_argument("--ranks-per-client", type=int, default=0,
                        help="ranks sharing one etcd client (default 0: one client a process)")
    parser.add_argument("--ranks-per-relay", type=int, default=0,
                        help="ranks a node's store relay serves (8: a node of 8 GPUs; default 0: no relay)")
    parser.add_argument("--relay-linger-ms", type=float, default=LINGER_S * 1e3,
                        help="how long a relay's batch waits for more requests (default: the runtime's)")
    parser.add_argument("--lockstep", type=int, default=0,
                        help="N consecutive ranks (a node) make each store call together (lazy, eager; default 0)")
    parser.add_argument("--endpoint", help="an etcd to use (default: start a fresh one)")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # a rank process (module doc)
    args = parser.parse_args()
    if args.child is not None:
        answers = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
        os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints must not reach the protocol
        _child(Part(**json.loads(args.child)), sys.stdin, answers)
        return
    print(f"{'pattern':>8} {'W':>6} {'P':>4} {'seconds':>9} {'etcd core-s':>11} {'in it':>6} {'etcd req/rank':>14} "
          f"{'events/rank':>12}  "
          "by method (per rendezvous)")
    with EtcdServer() if args.endpoint is None else _external(args.endpoint) as server:
        etcd = psutil.Process(server.pid) if isinstance(server, EtcdServer) and server.pid else None
        for pattern in args.pattern:
            for world in args.world:
                for procs in args.procs:
                    cpu0 = sum(etcd.cpu_times()[:2]) if etcd is not None else 0.0
                    r = rendezvous_seconds(server.endpoint, world, repeats=args.repeats, pattern=pattern,
                                           procs=procs, ranks_per_client=args.ranks_per_client,
                                           ranks_per_relay=args.ranks_per_relay,
                                           relay_linger_s=args.relay_linger_ms / 1e3,
                                           lockstep=args.lockstep if pattern != "nccl" else 0,
                                           etcd_pid=etcd.pid if etcd is not None else None)
                    # etcd's own CPU a rendezvous (set-up of the rank processes included): what it
                    # would take with the ranks' client work on hosts of their own
                    core_s = (sum(etcd.cpu_times()[:2]) - cpu0) / args.repeats if etcd is not None else float("nan")
                    methods = ", ".join(f"{m} {n:g}" for m, n in sorted(r["requests_by_method"].items()))
                    print(
                        f"{pattern:>8} {world:>6} {procs:>4} {r['seconds']:>9.3f} {core_s:>11.2f} "
                        f"{r['etcd_core_s'] if r['etcd_core_s'] is not None else float('nan'):>6.2f} "
                        f"{r['requests_per_rank']:>14.1f} {r['events_per_rank']:>12.1f}  {methods}",
                        flush=True,
                    )


class _external:
    """A context manager standing in for `EtcdServer` when `--endpoint` names a running etcd."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint

    def __enter__(self) -> "_external":
        return self

    def __exit__(self, *exc: object) -> None:
        return None


if __name__ == "__main__":
    main()
