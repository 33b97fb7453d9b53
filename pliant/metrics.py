"""Serving Prometheus metrics: the HTTP endpoint every pliant process exposes its injected registry on, and, where its
owner says how it is doing, ``/healthz`` beside it (a Kubernetes probe's target).

Each role defines its own metrics over a :class:`prometheus_client.CollectorRegistry` that its owner passes in
(``pliant.coordinator.metrics``, ``pliant.agent.metrics``, ``pliant.worker.metrics``); library code never touches the
global registry. This module only serves a registry and names the buckets the roles share.
"""

from __future__ import annotations

import argparse
import logging
import socket
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, disable_created_metrics, make_wsgi_app

from pliant import settings
from pliant.errors import ConfigError
from pliant.flags import typed
from pliant.net import parse_host_port

__all__ = ["FAST_BUCKETS_S", "SLOW_BUCKETS_S", "Health", "MetricsServer", "add_metrics_port_flag", "serve_metrics"]

logger = logging.getLogger(__name__)

FAST_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""RPCs, etcd operations, training steps."""
SLOW_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
"""Checkpoint saves and loads."""


Health = Callable[[], str]
"""How a process is doing, for ``/healthz``: "" when well, else why not (answered with 503)."""


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes and probes are not logged."""


@dataclass
class MetricsServer:
    """A running ``/metrics`` endpoint (any path answers, but ``/healthz`` when a health check was given)."""

    host: str
    port: int
    _httpd: WSGIServer
    _thread: threading.Thread

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def _with_health(metrics: Callable[..., Iterable[bytes]], health: Health) -> Callable[..., Iterable[bytes]]:
    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != "/healthz":
            return metrics(environ, start_response)
        problem = health()
        status = "503 Service Unavailable" if problem else "200 OK"
        start_response(status, [("Content-Type", "text/plain; charset=utf-8")])
        return [(problem or "ok").encode() + b"\n"]

    return app


def serve_metrics(registry: CollectorRegistry, listen: str, health: Health | None = None) -> MetricsServer:
    """Serve ``registry`` over HTTP on ``listen`` (HOST:PORT; port 0 picks a free one) from a daemon thread, and
    ``health`` on ``/healthz`` when given.

    Raises:
        ConfigError: the address is malformed or cannot be bound.
    """
    host, port = parse_host_port(listen, what="metrics address", allow_zero=True)
    disable_created_metrics()  # no `_created` series: a counter's start is its process's, which Prometheus knows
    app = make_wsgi_app(registry)
    if health is not None:
        app = _with_health(app, health)

    class Server(_Server):
        pass

    try:
        Server.address_family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM)[0][0]
        httpd = make_server(host, port, app, Server, handler_class=_QuietHandler)
    except OSError as exc:
        raise ConfigError(f"cannot serve metrics on {listen}: {exc}; pick a free --metrics-port") from exc
    thread = threading.Thread(target=httpd.serve_forever, name="metrics", daemon=True)
    thread.start()
    server = MetricsServer(host, httpd.server_address[1], httpd, thread)
    logger.info("metrics on http://%s/metrics", server.address)
    return server


def add_metrics_port_flag(parser: argparse.ArgumentParser, where: str) -> None:
    """``--metrics-port PORT`` (env PLIANT_METRICS_PORT; absent: no endpoint) for the command whose endpoint serves
    ``where``."""
    parser.add_argument(
        "--metrics-port",
        type=typed(int, "a port number"),
        default=settings.METRICS_PORT.flag_default(),  # converted when the command line is parsed
        help=f"serve Prometheus metrics ({where}) on this port; 0 picks a free one (env PLIANT_METRICS_PORT; "
        "default: no endpoint)",
    )
