"""A local copy of the keys under one etcd prefix, parsed: read once, then kept current by a
watch from the revision after that read (never from revision 1: auto-compaction drops old
history). The metrics endpoint (elastic/ops/metrics.py) keeps one per prefix it serves from; the
leader keeps one of the sync reports it decides on (elastic/roles/leader.py), decoded as they
arrive rather than all at once after the last one."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

from .etcd_api import EtcdClient
from .watch import WatchEvent, watch_from_now

log = logging.getLogger(__name__)


class PrefixMirror:
    """A local copy of the keys under one prefix, parsed: read once, then kept current by a watch
    from the revision after that read. `on_change` runs after each batch of changes is applied
    (on the watch's thread), so whoever it wakes reads them."""

    def __init__(self, client: EtcdClient, prefix: str, parse: Callable[[bytes], Any], *,
                 on_change: Callable[[], None] | None = None) -> None:
        self.prefix = prefix
        self._parse = parse
        self._on_change = on_change
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
                    self._items.pop(name, None)
                    log.warning("skipping malformed %s%s: %s", self.prefix, name, exc)
        if self._on_change is not None:
            self._on_change()

    def items(self) -> dict[str, Any]:
        """key (relative to the prefix) -> parsed value, a copy."""
        with self._lock:
            return dict(self._items)

    def pick(self, names: Iterable[str]) -> dict[str, Any]:
        """Those of `names` (relative to the prefix) that are there -> their parsed values."""
        with self._lock:
            return {n: v for n in names if (v := self._items.get(n)) is not None}

    def wait_ready(self, timeout: float) -> bool:
        return self._watch.wait_ready(timeout)

    def close(self) -> None:
        self._watch.cancel()
