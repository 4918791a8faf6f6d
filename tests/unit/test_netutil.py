"""Free loopback ports for servers: picked below the ephemeral range, so an outgoing connection's
source port cannot take one between the pick and the server's bind (specmesh/netutil.py)."""

import socket

from specmesh.netutil import _ephemeral_low, free_ports


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    ports = free_ports(8)
    assert len(set(ports)) == 8
    assert all(10000 <= p < _ephemeral_low() for p in ports)
    for p in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", p))

