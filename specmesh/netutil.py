"""Loopback port helpers shared by the launcher-side tools and the tests."""

from __future__ import annotations

import socket


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n distinct TCP ports free on host a moment ago (held open together, so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    """One TCP port free on host a moment ago (the OS picks it)."""
    return free_ports(1, host)[0]
