"""Serving Prometheus metrics: the HTTP endpoint every pliant process exposes its injected registry on.

Each role defines its own metrics over a :class:`prometheus_client.CollectorRegistry` that its owner passes in
(``pliant.coordinator.metrics``, ``pliant.agent.metrics``, ``pliant.worker.metrics``); library code never touches the
global registry. This module only serves a registry and names the buckets the roles share.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server

from pliant.errors import ConfigError
from pliant.net import parse_host_port

__all__ = ["FAST_BUCKETS_S", "SLOW_BUCKETS_S", "MetricsServer", "add_metrics_port_flag", "serve_metrics"]

logger = logging.getLogger(__name__)

FAST_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""RPCs, etcd operations, training steps."""
SLOW_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
"""Checkpoint saves and loads."""


@dataclass
class MetricsServer:
    """A running ``/metrics`` endpoint (any path answers)."""

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


def serve_metrics(registry: CollectorRegistry, listen: str) -> MetricsServer:
    """Serve ``registry`` over HTTP on ``listen`` (HOST:PORT; port 0 picks a free one) from a daemon thread.

    Raises:
        ConfigError: the address is malformed or cannot be bound.
    """
    host, port = parse_host_port(listen, what="metrics address", allow_zero=True)
    try:
        httpd, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise ConfigError(f"cannot serve metrics on {listen}: {exc}; pick a free --metrics-port") from exc
    server = MetricsServer(host, httpd.server_address[1], httpd, thread)
    logger.info("metrics on http://%s/metrics", server.address)
    return server


def add_metrics_port_flag(parser: argparse.ArgumentParser, where: str) -> None:
    """``--metrics-port PORT`` (env PLIANT_METRICS_PORT; absent: no endpoint) for the command whose endpoint serves
    ``where``."""
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=os.environ.get("PLIANT_METRICS_PORT") or None,  # argparse applies type= to a string default
        help=f"serve Prometheus metrics ({where}) on this port; 0 picks a free one (env PLIANT_METRICS_PORT; "
        "default: no endpoint)",
    )
