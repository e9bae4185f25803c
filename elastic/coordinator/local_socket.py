"""A node's local sockets: Unix stream sockets in Linux's abstract namespace (no file to clean
up), carrying one JSON object a line. The agent's relays serve them (`store_relay.py`,
elastic/roles/node_relay.py and node_feed.py) and its workers connect to them."""

from __future__ import annotations

import json
import socket
from typing import Any


def connect_abstract(name: str, timeout_s: float) -> socket.socket:
    """A connection to the abstract socket `name`, with `timeout_s` on every call; OSError (the
    socket closed) if nothing listens there."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(timeout_s)
        conn.connect("\0" + name)
    except BaseException:
        conn.close()
        raise
    return conn


def send_line(conn: socket.socket, message: dict[str, Any]) -> None:
    """`message` as one JSON line."""
    conn.sendall(json.dumps(message).encode() + b"\n")
