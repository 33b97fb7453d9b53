"""Small network helpers shared by every role: host:port parsing, free ports, and the address a node advertises."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket

from pliant.errors import ConfigError

__all__ = [
    "cannot_listen",
    "free_port",
    "interface_of",
    "is_loopback",
    "is_wildcard",
    "local_address",
    "parse_host_port",
]


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


def cannot_listen(host: str, port: int) -> str:
    """Why ``host:port`` cannot be listened on now, or ``""`` when it can.

    The probe binds with ``SO_REUSEADDR`` (as the servers do), so only a listener or a port that is not this machine's
    is in the way, never a connection left in TIME_WAIT.
    """
    if not 0 < port < 65536:
        return f"{port} is not a port (1-65535)"
    try:
        socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET).close()
    except OSError as exc:
        return os.strerror(exc.errno) if exc.errno else str(exc)
    return ""


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def is_loopback(host: str) -> bool:
    """True for a loopback address or ``localhost``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def is_wildcard(host: str) -> bool:
    """True for an address that means every interface (``0.0.0.0``, ``::``)."""
    return host in ("0.0.0.0", "::", "[::]", "")


def local_address(toward: str = "") -> str:
    """The IP address this machine's peers reach it on.

    Toward a known peer (``toward``, HOST or HOST:PORT), the source address of the route to it (a UDP socket's
    connect picks it; nothing is sent). Otherwise the first IPv4 address of an interface that is up and not loopback
    (psutil), else 127.0.0.1 (a machine with no network: everything is on this host).
    """
    if toward:
        host = toward.rsplit(":", 1)[0].strip("[]") if toward.count(":") == 1 or "]" in toward else toward
        with contextlib.suppress(OSError, UnicodeError):
            family, _type, _proto, _name, sockaddr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
            with socket.socket(family, socket.SOCK_DGRAM) as sock:
                sock.connect(sockaddr)
                return str(sock.getsockname()[0])
    import psutil

    stats = psutil.net_if_stats()
    for name, addresses in psutil.net_if_addrs().items():
        if name in stats and not stats[name].isup:
            continue
        for item in addresses:
            if item.family == socket.AF_INET:
                ip = ipaddress.ip_address(item.address)
                if not (ip.is_loopback or ip.is_link_local):
                    return item.address
    return "127.0.0.1"


def interface_of(address: str) -> str:
    """The name of this machine's network interface that holds IP ``address`` ("" when none does)."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(item.address.split("%")[0] == address for item in addresses):
            return name
    return ""
