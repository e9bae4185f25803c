"""The HTTP server behind a node's `/metrics` (elastic/ops/metrics.py).

prometheus_client's `start_http_server` runs `serve_forever` at socketserver's default poll of
0.5 s, and `shutdown()` waits for that loop to notice: every agent's exit waited up to half a
second for it (0.2-0.48 s of the 0.4-0.5 s that stopping a job's agents took here). This server
answers the same (prometheus_client's WSGI app, a thread a request) and polls every
`SHUTDOWN_POLL_S`.
"""

from __future__ import annotations

import socket
import threading
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

SHUTDOWN_POLL_S = 0.05
"""How often the serving loop looks for a shutdown: the longest `MetricsServer.close` waits."""


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        """A scrape is not worth a line in the agent's log."""


class MetricsServer:
    """`/metrics` of `registry` served on host:port (0: a free port) from a daemon thread."""

    def __init__(self, registry: CollectorRegistry, *, host: str, port: int) -> None:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        server_class = _Server6 if family == socket.AF_INET6 else _Server
        self._httpd = make_server(host, port, make_wsgi_app(registry), server_class, handler_class=_Quiet)
        self.address: tuple[str, int] = self._httpd.server_address[:2]  # type: ignore[assignment]
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": SHUTDOWN_POLL_S},
                                        name="metrics-http", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving (within `SHUTDOWN_POLL_S`) and free the port."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()
