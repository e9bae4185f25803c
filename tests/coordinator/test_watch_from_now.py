"""`watch_from_now` delivers what is there in revision order, as a watch would have: a subscriber
that falls back to it (elastic/roles/node_feed.py) keeps the order of the changes it missed.
Found by a CI run of tests/roles/test_node_feed.py, where the fallback read two decisions in key
order ("1/5" abort after "1/6" commit) and so told them in an order no watch gives."""

from __future__ import annotations

from typing import Any

import pytest

from elastic.coordinator.watch import WatchEvent, watch_from_now

pytestmark = pytest.mark.timeout(30)


def test_what_is_there_comes_in_revision_order(client: Any, job: str) -> None:
    prefix = f"/{job}/decisions/"
    client.put(prefix + "1/5", "commit")
    client.put(prefix + "1/6", "commit")
    client.put(prefix + "1/5", "abort")  # key order: 1/5, 1/6; revision order: 1/6, 1/5
    seen: list[WatchEvent] = []
    watch = watch_from_now(client, prefix, seen.extend)
    watch.cancel()
    assert [(ev.key[len(prefix):], ev.value) for ev in seen] == [("1/6", b"commit"), ("1/5", b"abort")]
    assert [ev.revision for ev in seen] == sorted(ev.revision for ev in seen)
