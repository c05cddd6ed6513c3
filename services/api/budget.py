"""Per-stream byte budgets: back-pressure on clients that do not read.

A bidi stream's handler works on requests while earlier replies wait to be written. gRPC
itself stops a write once the client's flow-control window is full, but everything the
handler computed meanwhile would pile up in server memory. A stream therefore reserves
the bytes of each reply before working on the request that produces it, and frees them
once the reply is written: when the client stops reading, the budget runs out, the
handler stops reading requests, and HTTP/2 flow control pushes back on the client.
"""

from __future__ import annotations

import asyncio

# Replies one stream may hold unwritten (the first reply always fits, however big).
STREAM_REPLY_BYTES = 4 * 1024 * 1024


class ByteBudget:
    def __init__(self, limit: int = STREAM_REPLY_BYTES) -> None:
        self.limit = limit
        self.used = 0
        self.peak = 0
        self._freed = asyncio.Event()

    async def acquire(self, n: int) -> None:
        """Waits until ``n`` more bytes fit (or nothing is held, so one big reply can pass)."""
        while self.used and self.used + n > self.limit:
            self._freed.clear()
            await self._freed.wait()
        self.used += n
        self.peak = max(self.peak, self.used)

    def try_acquire(self, n: int) -> bool:
        """``acquire`` without waiting: True (reserved) if ``n`` more bytes fit now."""
        if self.used and self.used + n > self.limit:
            return False
        self.used += n
        self.peak = max(self.peak, self.used)
        return True

    def release(self, n: int) -> None:
        self.used = max(0, self.used - n)
        self._freed.set()
