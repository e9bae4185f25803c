"""A local copy of the keys under one etcd prefix, parsed: read once, then kept current by a
watch from the revision after that read (never from revision 1: auto-compaction drops old
history). The metrics endpoint (metrics.py) keeps one per prefix it serves from."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from elastic.coordinator.etcd_api import EtcdClient
from elastic.coordinator.watch import WatchEvent, watch_from_now

log = logging.getLogger(__name__)


class PrefixMirror:
    """A local copy of the keys under one prefix, parsed: read once, then kept current by a watch
    from the revision after that read."""

    def __init__(self, client: EtcdClient, prefix: str, parse: Callable[[bytes], Any]) -> None:
        self.prefix = prefix
        self._parse = parse
        self._lock = threading.Lock()
        self._items: dict[str, Any] = {}
        self._watch = watch_from_now(client, prefix, self._on_events)

    def _on_events(self, events: list[WatchEvent]) -> None:
        with self._lock:
            for ev in events:
                name = ev.key[len(self.prefix) :]
                if ev.kind == "delete":
                    self._items.pop(name, None)
                    continue
                try:
                    self._items[name] = self._parse(ev.value)
                except (ValueError, TypeError, KeyError) as exc:
                    log.warning("metrics: skipping malformed %s%s: %s", self.prefix, name, exc)

    def items(self) -> dict[str, Any]:
        """key (relative to the prefix) -> parsed value, a copy."""
        with self._lock:
            return dict(self._items)

    def wait_ready(self, timeout: float) -> bool:
        return self._watch.wait_ready(timeout)

    def close(self) -> None:
        self._watch.cancel()
