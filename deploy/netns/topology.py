"""One Linux bridge and one network namespace per node, wired by veth pairs (needs root).

    root namespace                         namespace <prefix>n<k>
    bridge <prefix>br  10.213.S.1/24  ---  veth <prefix>h<k> === eth0  10.213.S.(10+k)/24

Every node sees the others and the bridge address (where etcd listens) through its own eth0,
so a node's traffic can be cut by downing its host-side veth: a real partition, unlike a
SIGSTOP. Names carry a per-launch prefix and the /24 is picked among unused ones, so several
launches can coexist. The host-side veth carries the alias `elastic-netns <prefix> node <k>`,
which is how deploy/netns/partition.sh finds it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

NODE_IFNAME = "eth0"
"""Name of each node's interface inside its namespace (as in a Kubernetes pod)."""

SICKLINK = Path(__file__).with_name("sicklink.py")
_SUBNET_BASE = "10.213"
_FIRST_HOST = 10


class NetnsUnavailable(RuntimeError):
    """Not root, or `ip netns` does not work here."""


def run_ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """`ip ARGS...`; raises RuntimeError with ip's own message when it fails and `check` is set."""
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip() or f'exit {proc.returncode}'}")
    return proc


def check_available() -> None:
    """Raise NetnsUnavailable (one line) unless this process can create namespaces and links."""
    if os.geteuid() != 0:
        raise NetnsUnavailable("the network-namespace launcher needs root (ip netns add, ip link add)")
    if shutil.which("ip") is None:
        raise NetnsUnavailable("the `ip` command (iproute2) is not installed")
    probe = f"elprobe{os.getpid() % 100000}"
    made = run_ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        raise NetnsUnavailable(f"`ip netns add` does not work here: {made.stderr.strip()}")
    run_ip("netns", "del", probe, check=False)


def _free_subnet() -> str:
    """The first 10.213.S (S in 1..254) that no interface of the root namespace uses."""
    used = set(re.findall(rf"inet {re.escape(_SUBNET_BASE)}\.(\d+)\.", run_ip("-4", "-o", "addr").stdout))
    for s in range(1, 255):
        if str(s) not in used:
            return f"{_SUBNET_BASE}.{s}"
    raise RuntimeError(f"every {_SUBNET_BASE}.S.0/24 subnet is in use")


@dataclass(frozen=True, kw_only=True)
class NodeNet:
    """One node's namespace and link."""

    node: int
    """Plan node number."""
    namespace: str
    """Network namespace name (`ip netns exec NAME ...`)."""
    host_veth: str
    """Root-namespace end of the veth pair (on the bridge); downing it partitions the node."""
    address: str
    """The node's IPv4 address inside its namespace (its ELASTIC_HOST)."""

    def exec_prefix(self) -> list[str]:
        """Command prefix that runs a program inside this node's namespace."""
        return ["ip", "netns", "exec", self.namespace]

    def env(self) -> dict[str, str]:
        """What the runtime needs to bind and advertise this node's address, gloo included."""
        return {"ELASTIC_HOST": self.address, "GLOO_SOCKET_IFNAME": NODE_IFNAME}


@dataclass
class Topology:
    """A bridge plus `nodes` namespaces; `create()` builds it, `destroy()` removes every part."""

    nodes: int
    prefix: str = field(default_factory=lambda: f"el{os.getpid() % 100000}")
    subnet: str = ""
    members: list[NodeNet] = field(default_factory=list)
    _created: list[tuple[str, str]] = field(default_factory=list)
    _relays: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= 200:
            raise ValueError(f"nodes must be in 1..200, got {self.nodes}")
        if not re.fullmatch(r"[a-z][a-z0-9]{0,7}", self.prefix):
            raise ValueError(
                f"prefix must be 1-8 lowercase letters/digits starting with a letter, got {self.prefix!r}"
            )

    @property
    def bridge(self) -> str:
        return f"{self.prefix}br"

    @property
    def bridge_address(self) -> str:
        """The root namespace's address on the bridge: where etcd listens."""
        assert self.subnet, "create() first"
        return f"{self.subnet}.1"

    @property
    def bridge_mac(self) -> str:
        """The bridge's fixed, locally administered MAC, from its subnet (unique per topology)."""
        octets = [int(x) for x in self.bridge_address.split(".")]
        return "02:" + ":".join(f"{o:02x}" for o in octets) + ":00"

    def node(self, node: int) -> NodeNet:
        for m in self.members:
            if m.node == node:
                return m
        raise ValueError(f"node {node} is not part of this topology (nodes 0..{self.nodes - 1})")

    def create(self) -> Topology:
        """Build the bridge and every namespace; on any failure, remove what was built and raise."""
        try:
            self.subnet = self.subnet or _free_subnet()
            run_ip("link", "add", self.bridge, "type", "bridge")
            self._created.append(("link", self.bridge))
            # A bridge without a MAC of its own takes its lowest port's, so taking a port off
            # (sicken, heal) could change the MAC behind etcd's address: every node's ARP entry
            # would go stale at once and every lease could expire. A set MAC never changes.
            run_ip("link", "set", self.bridge, "address", self.bridge_mac)
            run_ip("addr", "add", f"{self.bridge_address}/24", "dev", self.bridge)
            run_ip("link", "set", self.bridge, "up")
            for k in range(self.nodes):
                self.members.append(self._add_node(k))
        except BaseException:
            self.destroy()
            raise
        return self

    def _add_node(self, k: int) -> NodeNet:
        net = NodeNet(
            node=k,
            namespace=f"{self.prefix}n{k}",
            host_veth=f"{self.prefix}h{k}",
            address=f"{self.subnet}.{_FIRST_HOST + k}",
        )
        peer = f"{self.prefix}p{k}"
        run_ip("netns", "add", net.namespace)
        self._created.append(("netns", net.namespace))
        run_ip("link", "add", net.host_veth, "type", "veth", "peer", "name", peer)
        self._created.append(("link", net.host_veth))  # deleting one end deletes the pair
        run_ip("link", "set", net.host_veth, "alias", f"elastic-netns {self.prefix} node {k}")
        run_ip("link", "set", peer, "netns", net.namespace)
        run_ip("link", "set", net.host_veth, "master", self.bridge)
        run_ip("link", "set", net.host_veth, "up")
        ns = ["-n", net.namespace]
        run_ip(*ns, "link", "set", peer, "name", NODE_IFNAME)
        run_ip(*ns, "addr", "add", f"{net.address}/24", "dev", NODE_IFNAME)
        run_ip(*ns, "link", "set", NODE_IFNAME, "up")
        run_ip(*ns, "link", "set", "lo", "up")
        return net

    def set_link(self, node: int, *, up: bool) -> None:
        """Bring node `node`'s link up or down (down: none of its packets leave or arrive)."""
        run_ip("link", "set", self.node(node).host_veth, "up" if up else "down")

    # --- sick links and one-way partitions (launch.py --sick-link, --partition ...,mode=oneway) ---

    def sicken(self, node: int, *, delay_ms: float, loss: float, seed: int = 0) -> None:
        """Splice a delay/loss relay (sicklink.py) into node `node`'s link, in both directions.

        The node's host veth leaves the bridge; a new veth pair `<prefix>s<k>` / `<prefix>t<k>`
        takes its place there, and the relay copies frames between `<prefix>h<k>` and
        `<prefix>s<k>`. Addresses and MACs do not change: the node's connections carry on.
        """
        net = self.node(node)
        if node in self._relays:
            raise RuntimeError(f"node {node}'s link is already sick")
        side, port = f"{self.prefix}s{node}", f"{self.prefix}t{node}"
        run_ip("link", "add", side, "type", "veth", "peer", "name", port)
        self._created.append(("link", side))
        run_ip("link", "set", side, "up")
        relay = subprocess.Popen(
            [sys.executable, str(SICKLINK), "--node-side", net.host_veth, "--bridge-side", side,
             "--delay-ms", str(delay_ms), "--loss", str(loss), "--seed", str(seed)],
            stdout=subprocess.PIPE,
        )
        self._relays[node] = relay
        assert relay.stdout is not None
        if not relay.stdout.readline():  # its one line says both sockets are open and relaying
            self.heal(node)
            raise RuntimeError(f"the sick-link relay of node {node} failed to start (exit {relay.wait()})")
        run_ip("link", "set", net.host_veth, "nomaster")
        run_ip("link", "set", port, "master", self.bridge)
        run_ip("link", "set", port, "up")

    def heal(self, node: int) -> None:
        """Undo `sicken`: the host veth back on the bridge, the relay stopped, its veth pair deleted."""
        relay = self._relays.pop(node, None)
        if relay is None:
            return
        run_ip("link", "set", self.node(node).host_veth, "master", self.bridge, check=False)
        _stop_process(relay)
        side = f"{self.prefix}s{node}"
        run_ip("link", "del", side, check=False)
        if ("link", side) in self._created:
            self._created.remove(("link", side))

    def set_one_way(self, node: int, address: str, *, cut: bool) -> None:
        """Drop (cut) or pass again every packet node `node` sends to `address`; what `address`
        sends to the node still arrives. A blackhole route in the node's namespace: the kernel
        here has no tc drop action (no act_gact) and no iptables, and the route catches exactly
        the node's own packets, TCP ACKs included."""
        verb = "add" if cut else "del"
        run_ip("-n", self.node(node).namespace, "route", verb, "blackhole", f"{address}/32")

    def destroy(self) -> None:
        """Kill what still runs in the namespaces (by PID), then delete namespaces, veths and bridge."""
        for node in list(self._relays):
            self.heal(node)
        namespaces = [name for kind, name in self._created if kind == "netns"]
        for ns in namespaces:
            _kill_namespace_pids(ns)
        for kind, name in reversed(self._created):
            if kind == "netns":
                run_ip("netns", "del", name, check=False)
            else:
                run_ip("link", "del", name, check=False)
        self._created.clear()
        self.members.clear()


def _stop_process(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM a relay we started, SIGKILL it if it lingers, and reap it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=3.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _kill_namespace_pids(namespace: str) -> None:
    """SIGKILL every process still inside `namespace` (`ip netns pids`), and wait for them briefly."""
    pids = [int(p) for p in run_ip("netns", "pids", namespace, check=False).stdout.split()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
    deadline = time.monotonic() + 5.0
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if os.path.exists(f"/proc/{p}")]
        time.sleep(0.05)
