"""The address this node's servers bind and advertise: loopback unless the node says otherwise.

A simulated node on one machine uses 127.0.0.1. A node on its own host (or in its own network
namespace, see deploy/) sets ELASTIC_HOST to the address its peers reach it at; gloo picks its
interface from GLOO_SOCKET_IFNAME, which the deploy launchers set beside it.
"""

from __future__ import annotations

import ipaddress
import os

HOST_ENV = "ELASTIC_HOST"
LOOPBACK = "127.0.0.1"


def bind_host() -> str:
    """ELASTIC_HOST if set (an IP address, checked), else 127.0.0.1."""
    value = os.environ.get(HOST_ENV, "").strip()
    if not value:
        return LOOPBACK
    try:
        ipaddress.ip_address(value)
    except ValueError:
        raise ValueError(f"{HOST_ENV}={value!r} is not an IP address") from None
    return value
