"""Which TCP addresses a process listens on, read from /proc (Linux): its socket inodes
(/proc/<pid>/fd) matched against the LISTEN rows of /proc/<pid>/net/tcp and tcp6."""

from __future__ import annotations

import ipaddress
import os
import socket
import struct

LISTEN = "0A"


def _inodes(pid: int) -> set[str]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(target[8:-1])
    return out


def _address(hex_addr: str) -> str:
    ip_hex, port_hex = hex_addr.split(":")
    raw = bytes.fromhex(ip_hex)
    if len(raw) == 4:
        ip = socket.inet_ntop(socket.AF_INET, struct.pack("<I", int(ip_hex, 16)))
    else:  # four little-endian 32-bit words
        ip = socket.inet_ntop(socket.AF_INET6, b"".join(struct.pack("<I", int(ip_hex[i:i + 8], 16))
                                                         for i in range(0, 32, 8)))
    return f"{ip}:{int(port_hex, 16)}"


def listening(pid: int) -> list[str]:
    """host:port of every listening TCP socket the process holds."""
    inodes, found = _inodes(pid), []
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] == LISTEN and cols[9] in inodes:
                found.append(_address(cols[1]))
    return sorted(set(found))


def is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host == "localhost"
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1, a dual-stack socket bound to IPv4 loopback
    return (mapped or ip).is_loopback
