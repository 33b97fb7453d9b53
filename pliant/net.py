"""Small network helpers shared by every role: host:port parsing and free loopback ports."""

from __future__ import annotations

import socket

from pliant.errors import ConfigError

__all__ = ["free_port", "parse_host_port"]


def parse_host_port(
    value: str, *, what: str = "address", default_host: str | None = None, allow_zero: bool = False
) -> tuple[str, int]:
    """Parse ``HOST:PORT`` (or ``[v6]:PORT``) into a tuple.

    Args:
        value: the text to parse.
        what: the flag or field name used in the error message.
        default_host: host to use when ``value`` is just ``:PORT`` or ``PORT``.
        allow_zero: accept port 0 ("pick a free port"), for listen addresses.

    Raises:
        ConfigError: naming the value when it is not HOST:PORT with a port in 1..65535.
    """
    text = (value or "").strip()
    if text.startswith("http://") or text.startswith("https://"):
        text = text.split("://", 1)[1].rstrip("/")
    host, sep, port_text = text.rpartition(":")
    if not sep:
        host, port_text = "", text
    host = host.strip("[]") or (default_host or "")
    try:
        port = int(port_text)
    except ValueError:
        port = -1
    if not host or not (0 if allow_zero else 1) <= port < 65536:
        raise ConfigError(f"{what} {value!r} is not HOST:PORT with a port in 1..65535; e.g. 127.0.0.1:29400")
    return host, port


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
