"""A sick link: relay Ethernet frames between two interfaces with a fixed delay and random loss.

    python sicklink.py --node-side DEV_A --bridge-side DEV_B --delay-ms 50 --loss 1 --seed 0

What `tc qdisc add dev X root netem delay 50ms loss 1%` does, in user space: this machine's
kernel has neither `sch_netem` nor the `gact` drop action (only pfifo, tbf, htb and the u32
classifier), so the launcher splices this relay into a node's link instead (topology.py,
`Topology.sicken`). Each direction has its own thread pair: a reader takes every frame that
arrives on one interface (an AF_PACKET socket; frames this relay sent itself are skipped),
drops it with probability `loss`/100, and queues the rest with a due time `delay` ms later; a
writer sends them, in order, out of the other interface when due. Both directions are delayed,
so a round trip grows by twice the delay. The sockets use PACKET_VNET_HDR, so a TCP segment
that the kernel offloads (GSO, partial checksum) crosses whole: a lost "frame" may then be a
burst of up to 64 KiB of one TCP flow. Runs until SIGTERM/SIGINT; needs root (raw sockets).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import random
import signal
import socket
import sys
import threading
import time

ETH_P_ALL = 0x0003
SOL_PACKET = 263  # not exported by Python's socket module
PACKET_VNET_HDR = 15
PACKET_OUTGOING = 4
_FRAME_MAX = 65536 + 64
"""Largest read: a GSO frame (64 KiB) plus the virtio-net header and the Ethernet header."""


def open_port(device: str) -> socket.socket:
    """A raw socket that reads every frame arriving on `device` and sends frames out of it."""
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
    sock.bind((device, 0))
    return sock


def relay(
    source: socket.socket, sink: socket.socket, *, delay_s: float, loss: float, rng: random.Random,
    stop: threading.Event,
) -> list[threading.Thread]:
    """Start the reader and writer threads of one direction (source -> sink); return them."""
    due: queue.Queue[tuple[float, bytes]] = queue.Queue()

    def read() -> None:
        while not stop.is_set():
            try:
                frame, address = source.recvfrom(_FRAME_MAX)
            except OSError:
                return
            if address[2] == PACKET_OUTGOING or rng.random() * 100.0 < loss:
                continue
            due.put((time.monotonic() + delay_s, frame))

    def write() -> None:
        while not stop.is_set():
            try:
                at, frame = due.get(timeout=0.2)
            except queue.Empty:
                continue
            wait = at - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            try:
                sink.send(frame)
            except OSError:  # e.g. the link went away during teardown: the frame is lost
                continue

    threads = [threading.Thread(target=read, daemon=True), threading.Thread(target=write, daemon=True)]
    for t in threads:
        t.start()
    return threads


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--node-side", required=True, help="interface whose peer is the node's eth0")
    parser.add_argument("--bridge-side", required=True, help="interface whose peer is on the bridge")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="delay added in each direction")
    parser.add_argument("--loss", type=float, default=0.0, help="percent of frames dropped in each direction")
    parser.add_argument("--seed", type=int, default=0, help="seed of the loss draws")
    args = parser.parse_args(argv)
    if args.delay_ms < 0 or not 0 <= args.loss <= 100:
        print("sicklink.py: --delay-ms must be >= 0 and --loss in 0..100", file=sys.stderr)
        return 2
    with contextlib.suppress(OSError):  # the relay is the network, not a node: keep it off the CPU contention
        os.nice(-10)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    signal.signal(signal.SIGINT, lambda signum, frame: stop.set())
    node, bridge = open_port(args.node_side), open_port(args.bridge_side)
    rng = random.Random(args.seed)
    for source, sink, seed in ((node, bridge, rng.random()), (bridge, node, rng.random())):
        relay(source, sink, delay_s=args.delay_ms / 1000.0, loss=args.loss, rng=random.Random(seed), stop=stop)
    print(f"sicklink: {args.node_side} <-> {args.bridge_side}, delay {args.delay_ms:g} ms, "
          f"loss {args.loss:g}%", flush=True)
    while not stop.wait(0.5):
        pass
    node.close()
    bridge.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
