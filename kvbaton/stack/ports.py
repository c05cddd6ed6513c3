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
