"""`EtcdClient` (elastic/coordinator/etcd_api.py) says what the installed etcd3 really does.

mypy trusts the protocol for every call over etcd, and etcd3 has no types of its own, so these
tests hold the protocol to the library: every declared call exists on the stock client and on
`connect()`'s retrying one, with the declared parameters (names, order, defaults); and, against
the real etcd of the session, every answer has the fields the protocol declares, of their types.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import etcd3
import etcd3.transactions
import grpc
import pytest

from elastic.coordinator import EtcdConfig, connect, etcd_api
from elastic.coordinator.client import RetryingEtcdClient
from elastic.coordinator.etcd_api import Compare, EtcdClient, Transactions

pytestmark = pytest.mark.timeout(60)

CLIENT_CLASSES = [etcd3.MultiEndpointEtcd3Client, RetryingEtcdClient]

#: Where etcd3's range reads send their `**kwargs`: the options the protocol's `get*` declare.
RANGE_OPTIONS = inspect.signature(etcd3.MultiEndpointEtcd3Client._build_get_range_request).parameters

POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def declared_methods(protocol: type) -> dict[str, Callable[..., Any]]:
    """The methods written in `protocol`'s own body (not the ones `Protocol` adds)."""
    return {name: member for name, member in vars(protocol).items()
            if inspect.isfunction(member) and member.__qualname__.startswith(f"{protocol.__name__}.")}


def mismatches(declared: inspect.Signature, real: inspect.Signature,
               forwarded: Mapping[str, inspect.Parameter]) -> list[str]:
    """How `real` would refuse (or read differently) a call that `declared` allows; `forwarded`:
    the parameters `real`'s `**kwargs` end up in."""
    want = [p for p in declared.parameters.values() if p.name != "self"]
    have = {p.name: p for p in real.parameters.values() if p.name != "self"}
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in have.values())
    problems = []
    declared_order = [p.name for p in want if p.kind in POSITIONAL]
    real_order = [name for name, p in have.items() if p.kind in POSITIONAL]
    if real_order[: len(declared_order)] != declared_order:
        problems.append(f"positional parameters {declared_order}, etcd3 has {real_order}")
    for p in want:
        target = have.get(p.name) or (forwarded.get(p.name) if takes_kwargs else None)
        if target is None or target.kind is target.POSITIONAL_ONLY:
            problems.append(f"etcd3 takes no parameter {p.name!r}")
        elif p.default is not p.empty and target.default != p.default:
            problems.append(f"{p.name} defaults to {p.default!r}, in etcd3 to {target.default!r}")
    names = {p.name for p in want}
    problems += [f"etcd3 requires {name!r}, which is not declared" for name, p in have.items()
                 if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                 and name not in names]
    return problems


def nonconforming(value: Any, hint: Any, where: str) -> list[str]:
    """Where `value` lacks a field of the protocol `hint`, or holds a value of another type (only
    the plain types and the protocols of etcd_api are checked, recursively)."""
    if hint in (int, bytes, str, bool):
        return [] if isinstance(value, hint) else [f"{where} is {type(value).__name__}, not {hint.__name__}"]
    if typing.get_origin(hint) is Sequence:
        (item,) = typing.get_args(hint)
        return [p for i, v in enumerate(value) for p in nonconforming(v, item, f"{where}[{i}]")]
    if isinstance(hint, type) and vars(etcd_api).get(hint.__name__) is hint:
        problems = []
        for name, field in typing.get_type_hints(hint).items():
            if not hasattr(value, name):
                problems.append(f"{where} has no {name!r}")
            else:
                problems += nonconforming(getattr(value, name), field, f"{where}.{name}")
        return problems
    return []


def answers_as_declared(value: Any, method: str) -> list[str]:
    """`nonconforming` against what `EtcdClient.<method>` declares it returns."""
    return nonconforming(value, typing.get_type_hints(getattr(EtcdClient, method))["return"], method)


# -- without etcd: the calls and their parameters --------------------------------------------


@pytest.mark.parametrize("cls", CLIENT_CLASSES, ids=lambda c: c.__name__)
def test_every_declared_call_takes_the_declared_parameters(cls: type) -> None:
    declared = declared_methods(EtcdClient)
    assert {name for name in declared if not hasattr(cls, name)} == set()
    problems = {name: mismatches(inspect.signature(method), inspect.signature(getattr(cls, name)),
                                 RANGE_OPTIONS) for name, method in declared.items()}
    assert {name: p for name, p in problems.items() if p} == {}
    assert isinstance(inspect.getattr_static(cls, "channel"), property)


def test_the_transaction_helpers_take_the_declared_parameters() -> None:
    real = etcd3.Transactions()
    problems = {name: mismatches(inspect.signature(method), inspect.signature(getattr(real, name)), {})
                for name, method in declared_methods(Transactions).items()}
    assert {name: p for name, p in problems.items() if p} == {}
    compare_methods = declared_methods(Compare)
    assert set(compare_methods) == {"__eq__", "__ne__", "__lt__", "__gt__", "build_message"}
    for name, method in compare_methods.items():
        assert name in vars(etcd3.transactions.BaseCompare), name  # etcd3's own, not object's
        real_method = inspect.signature(getattr(etcd3.transactions.BaseCompare, name))
        assert mismatches(inspect.signature(method), real_method, {}) == [], name
    guard = real.create("/k") == 0
    assert isinstance(guard, etcd3.transactions.Create) and guard.build_message().create_revision == 0
    assert all(real.put("/k", "v").key == op.key == "/k" for op in (real.get("/k"), real.delete("/k")))


def test_the_stock_and_the_retrying_client_are_etcd_clients() -> None:
    stock = etcd3.MultiEndpointEtcd3Client(endpoints=[etcd3.Endpoint("127.0.0.1", 2379, secure=False)])
    ours = connect(EtcdConfig(endpoint="127.0.0.1:2379"))  # neither connects before a call
    try:
        assert isinstance(stock, EtcdClient) and isinstance(ours, EtcdClient)
        assert isinstance(ours, RetryingEtcdClient)
    finally:
        stock.close()
        ours.close()


def test_every_unary_call_of_the_protocol_is_retried() -> None:
    # get/get_prefix read through the retried *_response calls; a refresh is a stream (KeptLease
    # retries it); close is local.
    not_unary = {"get", "get_prefix", "refresh_lease", "close"}
    assert set(declared_methods(EtcdClient)) - not_unary - set(vars(RetryingEtcdClient)) == set()


# -- against etcd: the answers ---------------------------------------------------------------


def test_answers_have_the_declared_fields(client: EtcdClient, job: str) -> None:
    prefix = f"/etcd-api/{job}/"
    problems = answers_as_declared(client.put(prefix + "a", "1"), "put")
    value, meta = client.get(prefix + "a")
    assert value == b"1" and meta is not None
    problems += nonconforming(meta, etcd_api.KVMetadata, "get")
    assert client.get(prefix + "missing") == (None, None)
    pairs = list(client.get_prefix(prefix, sort_order="ascend"))
    assert [v for v, _ in pairs] == [b"1"]
    problems += nonconforming(pairs[0][1], etcd_api.KVMetadata, "get_prefix")
    problems += answers_as_declared(client.get_response(prefix + "a"), "get_response")
    problems += answers_as_declared(client.get_prefix_response(prefix, keys_only=True), "get_prefix_response")
    counted = client.get_range_response(prefix, prefix + "\xff", count_only=True)
    assert counted.count == 1 and not counted.kvs
    problems += answers_as_declared(counted, "get_range_response")

    txn = client.transactions
    ok, responses = client.transaction(
        compare=[txn.version(prefix + "a") > 0],
        success=[txn.get(prefix + "a"), txn.put(prefix + "b", b"2")],
        failure=[],
    )
    assert ok is True and responses[0][0][0] == b"1" and responses[1].response_put.header.revision > 0

    lease = client.lease(5)
    problems += answers_as_declared(lease, "lease")
    for refreshed in client.refresh_lease(lease.id):
        problems += nonconforming(refreshed, etcd_api.LeaseKeepAliveResponse, "refresh_lease")
    problems += answers_as_declared(client.get_lease_info(lease.id), "get_lease_info")
    assert client.revoke_lease(lease.id) is None
    assert client.get_lease_info(lease.id).TTL == -1

    assert client.delete(prefix + "a") is True and client.delete(prefix + "a") is False
    deleted = client.delete_prefix(prefix)
    assert deleted.deleted == 1
    problems += answers_as_declared(deleted, "delete_prefix")
    problems += answers_as_declared(client.status(), "status")
    assert isinstance(client.channel, grpc.Channel)
    assert client.call_credentials is None and client.metadata is None  # the test etcd has no auth
    assert problems == []
