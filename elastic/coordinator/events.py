"""The job's append-only event log in etcd (`events/`), read by the operator CLI."""

from __future__ import annotations

import json
import time
from typing import Any

from .etcd_api import EtcdClient
from .keys import JobKeys


def record_event(client: EtcdClient, keys: JobKeys, *, who: str, kind: str, **detail: Any) -> str:
    """Append one event {"time", "who", "kind", **detail}; returns its key."""
    now = time.time_ns()
    key = keys.key("events", now, who)
    client.put(key, json.dumps({"time": now / 1e9, "who": who, "kind": kind, **detail}))
    return key


def read_events(client: EtcdClient, keys: JobKeys) -> list[dict[str, Any]]:
    """All events of the job, oldest first."""
    return [json.loads(value) for value, _ in client.get_prefix(keys.events, sort_order="ascend")]
