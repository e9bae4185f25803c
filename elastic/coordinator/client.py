"""How to reach etcd: endpoint and TLS settings, and a client that survives an etcd restart.

`EtcdConfig` is what a launcher, a worker or the torchrun handler carries around; `connect()`
turns it into a `python3-etcd3` client, typed as the `EtcdClient` protocol (`etcd_api.py`). The
stock client marks an endpoint "failed" for 300 s after one UNAVAILABLE error, which would make
every call fail long after a restarted etcd is back; ours retries the endpoint at once. Its
unary calls (get, put, delete, transaction, lease grant/revoke, ...) also retry transient errors
for up to `EtcdConfig.retry_s` seconds, so an etcd restart shorter than that is invisible to
callers: they block, then succeed.

`endpoint` may list several members of one etcd cluster (`HOST:PORT,HOST:PORT,...`): `connect()`
then makes one `etcd3.Endpoint` per member and fails over between them. A member whose call
failed with a transient error is skipped for `_MEMBER_SKIP_S` seconds, so the retry goes to
another member; the retry budget (`retry_s`) is the same, so a member that dies is invisible to
callers when another one answers within it. The watches (`watch.py`, `store_waits.py`) open
their own streams on `channel` and call `fail_over` when a stream breaks.

One ambiguity remains: a transaction whose connection broke after etcd applied it is retried,
and a compare-and-swap retried that way reports failure although its first attempt succeeded.
Compare-and-swap callers already treat failure as "re-read and decide again", which covers it.

Credentials (user/password, CA, client certificate) come from the environment and a first read
names what is wrong with them: `credentials.py`. With a user set, an auth token etcd has let
expire is renewed once per call (`_renew_token`).
"""

from __future__ import annotations

import functools
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import etcd3
import etcd3.exceptions
import grpc

from .etcd_api import EtcdClient

log = logging.getLogger(__name__)

#: Errors that mean "etcd is unreachable right now", as opposed to a refused operation.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    etcd3.exceptions.ConnectionFailedError,
    etcd3.exceptions.ConnectionTimeoutError,
    etcd3.exceptions.InternalServerError,
    etcd3.exceptions.NoServerAvailableError,
    grpc.RpcError,
)


# Reconnect quickly after an etcd restart (gRPC's default backoff grows to minutes).
# etcd3.Endpoint hands this straight to grpc, which wants a sequence of pairs.
MAX_ANSWER_BYTES = 256 * 2**20
"""Largest etcd answer a client takes (etcd itself sends up to 2 GiB)."""

_GRPC_OPTIONS: Any = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
    # gRPC's client default is 4 MiB an answer: at 16,384 workers the leader's read of one
    # generation's sync reports is 3 MB (bench/control_plane_light.py) and a whole job's keys far more.
    ("grpc.max_receive_message_length", MAX_ANSWER_BYTES),
]


@dataclass(frozen=True, kw_only=True)
class EtcdConfig:
    """Connection settings for the job's etcd."""

    endpoint: str
    """`host:port` of etcd's client URL, or a comma-separated list of the client URLs of the
    members of one cluster (`host:port,host:port,...`; see `endpoints`)."""
    user: str | None = None
    """etcd user name when etcd has authentication enabled (needs `password`)."""
    password: str | None = None
    """Password of `user`."""
    ca_cert: str | None = None
    """Path of the CA bundle; setting it switches the connection to TLS."""
    cert_key: str | None = None
    """Path of the client key for mutual TLS (with `cert_cert`)."""
    cert_cert: str | None = None
    """Path of the client certificate for mutual TLS (with `cert_key`)."""
    timeout: float = 5.0
    """Deadline of each unary etcd call, in seconds (of each attempt, at most `_MEMBER_ATTEMPT_S`,
    with several members)."""
    retry_s: float = 5.0
    """How long a unary call keeps retrying while etcd is unreachable (0: fail at once); an etcd
    restart shorter than this is invisible to callers."""

    def __post_init__(self) -> None:
        parse_endpoints(self.endpoint)
        if (self.user is None) != (self.password is None):
            raise ValueError("etcd user and password must be given together")
        if (self.cert_key is None) != (self.cert_cert is None):
            raise ValueError("cert_key and cert_cert must be given together")
        if self.cert_key is not None and self.ca_cert is None:
            raise ValueError("mutual TLS (cert_key/cert_cert) needs ca_cert too")
        if self.timeout <= 0:
            raise ValueError(f"timeout must be positive, got {self.timeout}")
        if self.retry_s < 0:
            raise ValueError(f"retry_s must be >= 0, got {self.retry_s}")

    @property
    def endpoints(self) -> tuple[tuple[str, int], ...]:
        """(host, port) of each member, in the order given."""
        return parse_endpoints(self.endpoint)

    @property
    def host(self) -> str:
        """Host of the first member."""
        return self.endpoints[0][0]

    @property
    def port(self) -> int:
        """Port of the first member."""
        return self.endpoints[0][1]


def parse_endpoints(text: str) -> tuple[tuple[str, int], ...]:
    """(host, port) of each member of `HOST:PORT[,HOST:PORT...]`; ValueError naming the first bad
    member (empty, no port, a port outside 1..65535) or a member listed twice."""
    members = [m.strip() for m in text.split(",")]
    out: list[tuple[str, int]] = []
    for member in members:
        host, sep, port = member.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(
                f"etcd endpoint must look like host:port[,host:port...], got {member!r} in {text!r}"
            )
        if (host, int(port)) in out:
            raise ValueError(f"etcd endpoint {member!r} is listed twice in {text!r}")
        out.append((host, int(port)))
    return tuple(out)


RETRY_PAUSE_S = 0.1
"""Pause between two attempts of a retried call (and of `credentials.check_access`)."""

_MEMBER_ATTEMPT_S = 2.0
"""With several members: the deadline of one attempt of a unary call (at most `timeout`). A write
that a follower forwarded to a leader that then died is never answered (etcd waits out the
caller's deadline), so the attempt must end early enough for the retry on another member, after
the election (about 1 s), to fit in the retry budget."""

_MEMBER_SKIP_S = 1.0
"""With several members: how long a member whose call failed is passed over for the others (with
one, it is retried at once; when every member is passed over, calls retry until one is back)."""

#: What a retried call retries: etcd3's translations of UNAVAILABLE, DEADLINE_EXCEEDED and
#: INTERNAL. A raw grpc.RpcError (NOT_FOUND for a lease that expired, ...) is an answer.
_RETRIED_ERRORS: tuple[type[BaseException], ...] = (
    etcd3.exceptions.ConnectionFailedError,
    etcd3.exceptions.ConnectionTimeoutError,
    etcd3.exceptions.InternalServerError,
    etcd3.exceptions.NoServerAvailableError,
)

_SERVER_TIMEOUTS = ("context deadline exceeded", "request timed out", "context canceled")


def server_timed_out(exc: BaseException) -> bool:
    """Whether `exc` is etcd giving up inside the server: a member that lost its quorum holds a
    linearizable read or a write until the caller's deadline, then answers with its Go context's
    error as status UNKNOWN ("context deadline exceeded"), which etcd3 passes on as a raw
    grpc.RpcError. Transient: the call succeeds once a quorum is back."""
    if not isinstance(exc, grpc.RpcError) or not callable(getattr(exc, "code", None)):
        return False
    if exc.code() != grpc.StatusCode.UNKNOWN:
        return False
    details = (exc.details() or "").lower()
    return any(text in details for text in _SERVER_TIMEOUTS)


BUSY_RETRY_S = 60.0
"""How long a call that etcd refused as overloaded (`server_busy`) is retried, at least: etcd
asks for the retry, and the refused request was not applied, so retrying it is always safe."""
_BUSY_PAUSE_MAX_S = 2.0


def server_busy(exc: BaseException) -> bool:
    """Whether `exc` is etcd refusing a write while it applies its log more than 5,000 entries
    behind what it committed ("etcdserver: too many requests": UNKNOWN through etcd3,
    RESOURCE_EXHAUSTED in etcd's own table). 16,384 ranks setting their rendezvous addresses at
    once met it (bench/rendezvous_scale.py). Retried with a growing, random pause, so that the
    refused callers do not come back together and keep etcd behind."""
    if not isinstance(exc, grpc.RpcError) or not callable(getattr(exc, "code", None)):
        return False
    if exc.code() not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.RESOURCE_EXHAUSTED):
        return False
    return "too many requests" in (exc.details() or "").lower()


def stop_retrying(client: object) -> None:
    """Make `client`'s calls fail at once instead of retrying for `retry_s`: for a process that
    has given etcd up (unreachable past its give-up time) and only tidies up before it exits,
    where each retried call would wait out the whole budget in vain."""
    if isinstance(client, RetryingEtcdClient):
        client.retry_s = 0.0


def etcd_unreachable(exc: BaseException) -> bool:
    """Whether `exc` says etcd could not answer right now (unreachable, no quorum, timed out,
    overloaded):
    what a retried call raises once its retry budget is spent. A caller that can wait longer
    (the leader's loop) tries again later; any other error is an answer."""
    return isinstance(exc, _RETRIED_ERRORS) or server_timed_out(exc) or server_busy(exc)


def put_through_stall(client: Any, key: str, value: str, within_s: float) -> None:
    """Put `key`, trying again while etcd does not answer (a stall past the client's retries),
    for up to `within_s` seconds; the last error after that."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            client.put(key, value)
            return
        except Exception as exc:
            if not etcd_unreachable(exc) or time.monotonic() > deadline:
                raise
            time.sleep(RETRY_PAUSE_S)


#: The client's unary calls; `get`, `get_prefix` and friends go through the `*_response` ones.
_UNARY_CALLS = (
    "get_response", "get_prefix_response", "get_range_response", "get_all_response",
    "put", "put_if_not_exists", "replace", "delete", "delete_prefix", "transaction",
    "lease", "revoke_lease", "get_lease_info", "status",
)


class RetryingEtcdClient(etcd3.MultiEndpointEtcd3Client):
    """A client whose unary calls retry transient errors for `retry_s` seconds (module doc).

    It keeps etcd3's signatures (each retried call wraps the original with `functools.wraps`),
    so it is an `EtcdClient` like the stock client (tests/coordinator/test_etcd_api.py).
    """

    retry_s: float = 0.0
    credentials: tuple[str, str] | None = None
    """(user, password) to authenticate again with when etcd forgets our token (`_renew_token`)."""


def _retrying(call: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(call)
    def retried(self: RetryingEtcdClient, *args: Any, **kwargs: Any) -> Any:
        start = time.monotonic()
        deadline = start + self.retry_s
        renewed, busy = False, 0
        while True:
            try:
                return call(self, *args, **kwargs)
            except (*_RETRIED_ERRORS, grpc.RpcError) as exc:
                if server_busy(exc) and self.retry_s > 0:  # refused, not applied: back off and retry
                    pause = random.uniform(0, min(_BUSY_PAUSE_MAX_S, RETRY_PAUSE_S * 2**busy))
                    busy += 1
                    if time.monotonic() + pause > start + max(self.retry_s, BUSY_RETRY_S):
                        raise
                    time.sleep(pause)
                    continue
                if etcd_unreachable(exc):  # unreachable, or no quorum behind the member
                    if time.monotonic() + RETRY_PAUSE_S > deadline:
                        raise
                    log.debug("etcd %s failed (%s); retrying", call.__name__, type(exc).__name__)
                    time.sleep(RETRY_PAUSE_S)
                    continue
                # an auth token that expired unused (past etcd's --auth-token-ttl)
                if renewed or not isinstance(exc, grpc.RpcError) or not _renew_token(self, exc):
                    raise
                renewed = True

    return retried


for _name in _UNARY_CALLS:
    setattr(RetryingEtcdClient, _name, _retrying(getattr(etcd3.MultiEndpointEtcd3Client, _name)))


def connect(config: EtcdConfig) -> EtcdClient:
    """A client for `config`: its endpoint is retried at once after a failure, its unary calls
    for `config.retry_s` seconds."""
    secure = config.ca_cert is not None
    creds = None
    if secure:
        creds = etcd3.MultiEndpointEtcd3Client.get_secure_creds(
            config.ca_cert, config.cert_key, config.cert_cert
        )
    # -- one etcd3.Endpoint per member, failing over between them (module doc) --
    skip_s = _MEMBER_SKIP_S if len(config.endpoints) > 1 else 0.0
    endpoints = [
        etcd3.Endpoint(host, port, secure=secure, creds=creds, time_retry=skip_s, opts=_GRPC_OPTIONS)
        for host, port in config.endpoints
    ]
    timeout = min(config.timeout, _MEMBER_ATTEMPT_S) if len(endpoints) > 1 else config.timeout
    client = _authenticated(  # with a user, the constructor authenticates: retried like a call
        lambda: RetryingEtcdClient(
            endpoints=endpoints, timeout=timeout, user=config.user, password=config.password,
            failover=len(endpoints) > 1,
        ),
        config.retry_s,
    )
    client.retry_s = config.retry_s
    if config.user is not None and config.password is not None:
        client.credentials = (config.user, config.password)
    return client


def tls_failed(details: str) -> bool:
    """Whether gRPC's details tell of a failed TLS handshake (not a TCP one cut short, which
    "tcp handshaker shutdown" is: a deadline under load)."""
    lowered = details.lower()
    return "tls handshake failed" in lowered or "ssl handshake failed" in lowered or "ssl_error" in lowered


def _authenticated(make: Callable[[], RetryingEtcdClient], retry_s: float) -> RetryingEtcdClient:
    """`make()`, retried for `retry_s` seconds while etcd is unreachable: etcd3's constructor
    sends the Authenticate call when a user is set (a raw gRPC call, outside the retried ones)."""
    deadline = time.monotonic() + retry_s
    while True:
        try:
            return make()
        except grpc.RpcError as exc:
            transient = exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
            if not transient or tls_failed(exc.details() or "") or time.monotonic() + RETRY_PAUSE_S > deadline:
                raise
            log.debug("etcd authentication failed (%s); retrying", exc.code())
            time.sleep(RETRY_PAUSE_S)


def _renew_token(client: RetryingEtcdClient, exc: grpc.RpcError) -> bool:
    """Authenticate `client` again when `exc` says etcd no longer knows its token: etcd's simple
    tokens expire after --auth-token-ttl (300 s) unused, and a worker may not touch etcd for
    longer than that between two failures. True when a new token is in place (retry the call)."""
    if client.credentials is None or exc.code() != grpc.StatusCode.UNAUTHENTICATED:
        return False
    if "invalid auth token" not in (exc.details() or ""):
        return False
    from etcd3 import etcdrpc
    from etcd3.client import EtcdTokenCallCredentials

    user, password = client.credentials
    reply = client.authstub.Authenticate(etcdrpc.AuthenticateRequest(name=user, password=password), client.timeout)
    client.metadata = (("token", reply.token),)
    client.call_credentials = grpc.metadata_call_credentials(EtcdTokenCallCredentials(reply.token))
    log.info("etcd forgot the auth token of user %s; authenticated again", user)
    return True


def fail_over(client: EtcdClient) -> None:
    """Pass over the member `client` is talking to (its stream broke), so that the next use of
    `client.channel` goes to another member; nothing with a single endpoint."""
    endpoints = getattr(client, "endpoints", None)
    if isinstance(endpoints, dict) and len(endpoints) > 1:
        in_use = getattr(client, "endpoint_in_use", None)
        if in_use is not None:
            in_use.fail()
