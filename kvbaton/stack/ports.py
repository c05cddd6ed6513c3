"""A free TCP port for a server this process is about to start (loopback by default)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that is free right now (bind to port 0, read it, close).

    There is an unavoidable race until the server binds it; callers that start many
    servers should retry on "address in use" (``VllmServer`` surfaces it in its log).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct TCP ports that are free right now.

    Why not ``free_port()`` ``count`` times: each closes its socket before the next binds,
    so the kernel may hand the same port out twice (a 3-member etcd cluster then fails with
    "initial cluster ... has duplicate url"). Here every socket stays bound until all are
    chosen. The race with other processes until the servers bind is the same as above."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()
