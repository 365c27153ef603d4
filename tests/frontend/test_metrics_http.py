"""The metrics endpoint's HTTP server alone (no engine): concurrent connections, and a timeout
that ends a silent client's connection, so idle or slow clients can neither block a scrape nor
pile up threads for ever."""

from __future__ import annotations

import socket
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from raypaged.frontend.metrics_http import MetricsHTTPServer


@pytest.fixture
def endpoint():
    registry = CollectorRegistry()
    Counter("probe", "a probe", registry=registry).inc()
    server = MetricsHTTPServer("127.0.0.1", 0, registry, idle_timeout_s=0.5)
    yield server
    server.close()


def scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()


def test_scrapes_go_on_beside_idle_connections(endpoint):
    idle = [socket.create_connection(("127.0.0.1", endpoint.port), timeout=30) for _ in range(16)]
    try:
        for _ in range(3):
            assert "probe_total 1.0" in scrape(endpoint.port)
    finally:
        for sock in idle:
            sock.close()


@pytest.mark.parametrize("sent", [b"", b"GET /metrics HTTP/1.1\r\n", b"GET /met"])
def test_a_silent_client_is_disconnected(endpoint, sent):
    """Nothing sent, the headers never ended, or the request line cut: the server closes the
    connection once the client has been silent for the idle timeout (recv sees EOF; the 30 s
    here only bound a broken server)."""
    with socket.create_connection(("127.0.0.1", endpoint.port), timeout=30) as sock:
        sock.sendall(sent)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        assert not data.startswith(b"HTTP/1.1 200"), data
    assert "probe_total 1.0" in scrape(endpoint.port)


def test_close_releases_the_port():
    server = MetricsHTTPServer("127.0.0.1", 0, CollectorRegistry())
    port = server.port
    server.close()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # free again
