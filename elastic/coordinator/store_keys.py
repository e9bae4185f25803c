"""How one `EtcdStore` key lies in etcd (store.py's module doc): its value at `<prefix>k`, its
`add` deltas at `k\\0<id>` and its queue items at `k\\0\\2<id>`, all in `[k, k\\1)`; and what a read
of that range means (`_Counter`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_DELTA = "\x00"
"""Separates a key from the unique id of one of its `add` deltas (`k\\0<id>` sorts in `[k, k\\1)`)."""
_END = "\x01"
FOLD_EVERY = 32
"""The adder that sees this many deltas of a counter folds them into its value."""
_FOLD_MAX = 60
"""Most deltas one fold removes (each costs a compare and a delete; etcd allows 128 txn ops)."""
_MULTI_SET_CHUNK = 60
"""Keys a `multi_set` writes per transaction (two operations each)."""
_QUEUE = "\x00\x02"
"""Separates a queue key from the unique id of one of its items (inside `[k, k\\1)`, apart from
the `add` deltas, whose ids are hexadecimal)."""
_QUEUE_END = "\x00\x03"
_KEEP_LIMIT = 2 * FOLD_EVERY
"""Most etcd keys a `wait` reads of one store key (its value and deltas, or a queue's items)."""

def _as_bytes(value: str | bytes | bytearray | list[int]) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


def _logical(full_key: bytes) -> bytes:
    """The store key an etcd key belongs to (a delta key belongs to its counter)."""
    return full_key.split(_DELTA.encode(), 1)[0]


def _note(full: str, count: int, more: bool, kvs: Sequence[Any], missing: set[bytes], values: dict[bytes, bytes]) -> None:
    """Note one range read `[full, full\\1)` of `_present`: missing, or the value `get` would return."""
    if not count:
        missing.add(full.encode())
    elif not more:  # a long queue or an unfolded counter: nothing kept
        try:
            value = _Counter(full, [(kv.value, kv) for kv in kvs]).value(full)
        except ValueError:  # a queue's items, or deltas on a non-integer: not a value
            return
        if value is not None:
            values[full.encode()] = value


class _Counter:
    """The etcd keys `[k, k\\1)` of one store key, as one read returned them."""

    def __init__(self, full: str, kvs: Sequence[tuple[bytes, Any]]) -> None:
        self.base: bytes | None = None
        self.base_mod = 0
        self.deltas: list[tuple[str, int]] = []
        own = full.encode()
        for value, meta in kvs:
            if meta.key == own:
                self.base, self.base_mod = bytes(value), int(meta.mod_revision)
            else:
                self.deltas.append((meta.key.decode(), int(value)))

    @property
    def exists(self) -> bool:
        return self.base is not None or bool(self.deltas)

    def total(self, key: str) -> int:
        try:
            base = int(self.base) if self.base is not None else 0
        except ValueError:
            raise ValueError(f"store key {key!r} holds {self.base!r}, not an integer: cannot add") from None
        return base + sum(d for _, d in self.deltas)

    def value(self, key: str) -> bytes | None:
        """What `get` returns: the value, or the sum once `add` wrote deltas; None if missing."""
        if not self.deltas:
            return self.base
        return str(self.total(key)).encode()


