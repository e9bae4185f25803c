"""The etcd client as this project uses it: a typed view of `python3-etcd3`.

etcd3 ships no type information, so without this module every call on the client (and
everything read from its answers) is `Any` to mypy: the coordinator / leader / worker
conversation over etcd went unchecked. `EtcdClient` declares exactly the calls the project
makes, with etcd3's own parameter names, and what they return as far as the project reads it;
it is the single place that says so. `connect()` (`client.py`) returns one, and every function
or object that holds a client takes one. `tests/coordinator/test_etcd_api.py` checks the
declarations against the installed etcd3 (and the retrying client) so they cannot drift.

The answers are protobuf messages (`etcdrpc`) or etcd3's small wrappers of them; the protocols
below name only the fields the project reads. Keys are `str` (etcd3 encodes them as UTF-8).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Literal, Protocol, TypeAlias, runtime_checkable

import grpc

# -- answers -------------------------------------------------------------------------------


class ResponseHeader(Protocol):
    """The header of every etcd answer (`etcdrpc.ResponseHeader`)."""

    revision: int
    """The store's revision when the request was served."""


class KeyValue(Protocol):
    """One key as a range read returns it (`etcdrpc.KeyValue`)."""

    key: bytes
    value: bytes
    """Empty for a `keys_only` read."""
    create_revision: int
    mod_revision: int
    version: int
    lease: int
    """The id of the lease the key is attached to (0: none)."""


class KVMetadata(Protocol):
    """What etcd3's `get` / `get_prefix` pair with each value (`etcd3.client.KVMetadata`)."""

    key: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease_id: int
    """The id of the lease the key is attached to (0: none)."""
    response_header: ResponseHeader


class RangeResponse(Protocol):
    """The answer of a `*_response` read (`etcdrpc.RangeResponse`)."""

    header: ResponseHeader
    kvs: Sequence[KeyValue]
    """The keys read, in key order (none for `count_only`)."""
    count: int
    """How many keys are in the range, whatever `count_only` says."""
    more: bool
    """Whether the range holds more keys than a `limit` let through."""


class PutResponse(Protocol):
    """The answer of a `put` (`etcdrpc.PutResponse`)."""

    header: ResponseHeader


class DeleteRangeResponse(Protocol):
    """The answer of a `delete_prefix` (`etcdrpc.DeleteRangeResponse`)."""

    header: ResponseHeader
    deleted: int
    """How many keys were deleted."""


class Lease(Protocol):
    """A granted lease (`etcd3.Lease`)."""

    id: int
    ttl: int
    """The TTL etcd granted, in seconds."""


class LeaseKeepAliveResponse(Protocol):
    """One answer of `refresh_lease` (`etcdrpc.LeaseKeepAliveResponse`)."""

    ID: int
    TTL: int
    """The TTL after the refresh, in seconds; <= 0 when the lease had already expired."""


class LeaseTimeToLiveResponse(Protocol):
    """The answer of `get_lease_info` (`etcdrpc.LeaseTimeToLiveResponse`)."""

    ID: int
    TTL: int
    """Seconds left; -1 when the lease does not exist (expired or revoked)."""
    grantedTTL: int  # noqa: N815  (etcd's field name)
    """The TTL the lease was granted with, in seconds."""


class ClusterStatus(Protocol):
    """The answer of `status` about the member that served it (`etcd3.client.Status`)."""

    version: str
    db_size: int
    """Bytes of the member's database file."""
    raft_index: int
    raft_term: int


#: One entry of a transaction's answer, in the order of the branch's operations: an
#: `etcdrpc.ResponseOp` for a put or a delete (`.response_put`, `.response_delete_range`), a list
#: of `(value, KVMetadata)` pairs for a get. etcd3 mixes both in one list and only the caller knows
#: which operation it put where, so this stays `Any`.
TxnResponse: TypeAlias = Any

SortOrder: TypeAlias = Literal["ascend", "descend"]
SortTarget: TypeAlias = Literal["key", "version", "create", "mod", "value"]

# -- transactions --------------------------------------------------------------------------


class Compare(Protocol):
    """A transaction guard: `transactions.value(key) == b"x"`, `transactions.create(key) == 0`, ...

    etcd3's comparison operators record the operator and return the same object, which the
    transaction then builds into an `etcdrpc.Compare`; it is complete once compared.
    """

    def __eq__(self, other: object) -> Compare:  # type: ignore[override]  # builds, not tests
        ...

    def __ne__(self, other: object) -> Compare:  # type: ignore[override]  # builds, not tests
        ...

    def __lt__(self, other: int) -> Compare: ...

    def __gt__(self, other: int) -> Compare: ...

    def build_message(self) -> Any:
        """The `etcdrpc.Compare` the transaction sends."""
        ...


class TxnOp(Protocol):
    """An operation of a transaction branch: `transactions.put`, `.get` or `.delete`."""

    key: str


class Transactions(Protocol):
    """The client's `transactions` namespace: the guards and operations of a transaction.

    Each is an etcd3 class; calling it makes a guard or an operation. A `range_end` turns a guard
    or an operation on `key` into one on the keys in [key, range_end).
    """

    def value(self, key: str, range_end: str | None = None) -> Compare: ...

    def version(self, key: str, range_end: str | None = None) -> Compare: ...

    def create(self, key: str, range_end: str | None = None) -> Compare: ...

    def mod(self, key: str, range_end: str | None = None) -> Compare: ...

    def put(self, key: str, value: str | bytes, lease: int | None = None, prev_kv: bool = False) -> TxnOp: ...

    def get(self, key: str, range_end: str | None = None) -> TxnOp: ...

    def delete(self, key: str, range_end: str | None = None, prev_kv: bool = False) -> TxnOp: ...


# -- the client ----------------------------------------------------------------------------


@runtime_checkable
class EtcdClient(Protocol):
    """An etcd v3 client: `etcd3.MultiEndpointEtcd3Client` or the retrying one of `connect()`.

    Range reads (`get*`) take the same keyword options: `keys_only` (values come back empty),
    `count_only` (no keys, only `count`), `sort_order` and `revision` (read the store as it was).
    """

    transactions: Transactions
    """Makes the guards and operations that `transaction` takes."""
    call_credentials: grpc.CallCredentials | None
    """The auth token's credentials (None without etcd auth); for a raw RPC on `channel`."""
    metadata: tuple[tuple[str, str], ...] | None
    """The auth token as call metadata (None without etcd auth); for a raw RPC on `channel`."""

    @property
    def channel(self) -> grpc.Channel:
        """The gRPC channel to the endpoint in use (the watches call the Watch RPC on it)."""
        ...

    def get(
        self, key: str, *, keys_only: bool = False, count_only: bool = False,
        sort_order: SortOrder | None = None, revision: int | None = None,
    ) -> tuple[bytes, KVMetadata] | tuple[None, None]:
        """The value of `key` and its metadata, or (None, None) when it does not exist."""
        ...

    def get_response(
        self, key: str, *, keys_only: bool = False, count_only: bool = False,
        sort_order: SortOrder | None = None, revision: int | None = None,
    ) -> RangeResponse:
        """`get` as etcd answers it (at most one key in `kvs`)."""
        ...

    def get_prefix(
        self, key_prefix: str, *, keys_only: bool = False, count_only: bool = False,
        sort_order: SortOrder | None = None, revision: int | None = None,
    ) -> Iterator[tuple[bytes, KVMetadata]]:
        """(value, metadata) of every key under `key_prefix`, read at one revision."""
        ...

    def get_prefix_response(
        self, key_prefix: str, *, keys_only: bool = False, count_only: bool = False,
        sort_order: SortOrder | None = None, revision: int | None = None,
    ) -> RangeResponse:
        """`get_prefix` as etcd answers it (with the revision of the read in `header`)."""
        ...

    def get_range_response(
        self, range_start: str, range_end: str, *, keys_only: bool = False, count_only: bool = False,
        sort_order: SortOrder | None = None, revision: int | None = None, sort_target: SortTarget = "key",
        limit: int | None = None,
    ) -> RangeResponse:
        """The keys in [range_start, range_end); with `limit`, only the first ones in the order of
        `sort_target` (the key, or the revision that created it: "create")."""
        ...

    def put(self, key: str, value: str | bytes, lease: int | None = None) -> PutResponse:
        """Write `key`, attached to lease `lease` (an id) if given."""
        ...

    def delete(self, key: str) -> bool:
        """Delete `key`; whether it existed."""
        ...

    def delete_prefix(self, prefix: str) -> DeleteRangeResponse:
        """Delete every key under `prefix`."""
        ...

    def transaction(
        self, compare: Sequence[Compare], success: Sequence[TxnOp] | None = None,
        failure: Sequence[TxnOp] | None = None,
    ) -> tuple[bool, list[TxnResponse]]:
        """Run `success` if every guard of `compare` holds, else `failure` (pass both as lists,
        empty ones included): whether the guards held, and the answers of the branch that ran."""
        ...

    def lease(self, ttl: int, lease_id: int | None = None) -> Lease:
        """Grant a lease of `ttl` seconds."""
        ...

    def refresh_lease(self, lease_id: int) -> Iterator[LeaseKeepAliveResponse]:
        """Refresh the lease once (the answer comes through the iterator)."""
        ...

    def revoke_lease(self, lease_id: int) -> None:
        """Revoke the lease: every key attached to it is deleted at once."""
        ...

    def get_lease_info(self, lease_id: int) -> LeaseTimeToLiveResponse:
        """The lease's remaining and granted TTL."""
        ...

    def status(self) -> ClusterStatus:
        """The status of the member that answers (the benchmarks read its db size)."""
        ...

    def close(self) -> None:
        """Close the channels (and etcd3's own watcher, unused here)."""
        ...
