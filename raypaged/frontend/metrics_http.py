"""The Prometheus endpoint: prometheus_client's WSGI app on its threading server, with timeouts.

A thread per connection, so a client that connects and sends nothing (or trickles its request
in) never holds up another scrape; and a socket timeout on each connection, so such a client
holds its thread for `idle_timeout_s` at most instead of for ever. (prometheus_client's own
start_http_server is this server without the timeout.)
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

logger = logging.getLogger(__name__)

DEFAULT_IDLE_TIMEOUT_S = 10.0  # a scrape sends its request at once; 10 s of silence is no scraper


class _Server(ThreadingWSGIServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that went silent (timed out) or away is routine here, not a traceback.
        error = sys.exc_info()[1]
        if isinstance(error, (TimeoutError, ConnectionError)):
            logger.debug("metrics client %s: %s", client_address, error)
            return
        super().handle_error(request, client_address)


def _handler(idle_timeout_s: float) -> type[WSGIRequestHandler]:
    class Handler(WSGIRequestHandler):
        timeout = idle_timeout_s  # per socket operation: a silent client's read times out

        def log_message(self, format: str, *args: Any) -> None:  # one line per scrape is noise
            pass

    return Handler


class MetricsHTTPServer:
    """Serves `registry` on http://host:port/metrics (port 0: any free one) from a daemon thread
    until close()."""

    def __init__(self, host: str, port: int, registry: CollectorRegistry,
                 idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S) -> None:
        server_class = type("MetricsServer", (_Server,), {"address_family": _family(host, port)})
        self._httpd: ThreadingWSGIServer = make_server(host, port, make_wsgi_app(registry), server_class,
                                  handler_class=_handler(idle_timeout_s))
        self.port: int = self._httpd.server_port
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="metrics-http", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def _family(host: str, port: int) -> socket.AddressFamily:
    """IPv6 for an IPv6 host (http.server's choice), IPv4 otherwise."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    return infos[0][0] if infos else socket.AF_INET
