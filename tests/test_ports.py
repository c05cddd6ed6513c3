"""``free_ports`` hands out distinct ports: a 3-member etcd cluster given the same port
twice (``free_port()`` called six times can return one twice) fails to start with
"initial cluster ... has duplicate url", as a CI run did."""

from __future__ import annotations

import socket

from kvbaton.stack.ports import free_ports


def test_ports_are_distinct_and_free_once_returned():
    ports = free_ports(64)
    assert len(ports) == len(set(ports)) == 64
    for port in ports[:8]:  # each can be bound by the server it is for
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
