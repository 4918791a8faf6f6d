"""Loopback port helpers shared by the launcher-side tools and the tests.

Ports are picked below the kernel's ephemeral range (net.ipv4.ip_local_port_range), which is
where the source ports of outgoing connections come from: a port the OS handed out by bind(0)
was free a moment ago, but any connection made before the server binds it (a Redis client, a
gRPC channel) may take it as its source port ("Address already in use": the CI soak slice of
session 36). Below that range only an explicit bind takes a port, and each pick is checked by one.
"""

from __future__ import annotations

import random
import socket

_FLOOR = 10000  # lowest port picked (below: well-known and registered services)


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; elsewhere bind(0) decides (see free_ports)


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n distinct TCP ports free on host a moment ago (held open together, so they differ),
    below the ephemeral range where it leaves room; else the OS's pick (bind to port 0)."""
    socks: list[socket.socket] = []
    low = _ephemeral_low()
    candidates = random.sample(range(_FLOOR, low), min(low - _FLOOR, 64 * n)) if low - _FLOOR >= 64 * n else []
    try:
        for port in candidates:
            if len(socks) == n:
                break
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind((host, port))
            except OSError:
                s.close()
                continue
            socks.append(s)
        while len(socks) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    """One TCP port free on host a moment ago (see free_ports)."""
    return free_ports(1, host)[0]
