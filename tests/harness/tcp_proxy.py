"""A TCP proxy the tests control, for network partitions between a service and etcd.

``partition()`` black-holes traffic: open connections stop forwarding (bytes are read and
dropped, as with lost packets, so the peers see silence rather than a reset) and new
connections are accepted and ignored. ``heal()`` resets every connection so clients
reconnect and lets traffic flow again. Runs its own event loop on a thread, so it works
for subprocess clients and in-process ones alike.
"""

from __future__ import annotations

import asyncio
import socket
import threading


class TcpProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.partitioned = False
        self._conns: set[asyncio.StreamWriter] = set()
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True, name=f"tcp-proxy-{target_port}")
        self.thread.start()
        if not ready.wait(10):
            raise RuntimeError("proxy did not start")

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.server = self.loop.run_until_complete(asyncio.start_server(self._handle, sock=sock))
        ready.set()
        self.loop.run_forever()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._conns.add(writer)
        try:
            if self.partitioned:
                while await reader.read(65536):  # black hole
                    pass
                return
            up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(*self.target), 5)
            self._conns.add(up_writer)
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        except (TimeoutError, OSError):
            pass
        finally:
            for w in (writer,):
                w.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                if self.partitioned:
                    continue  # dropped on the floor
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()
            self._conns.discard(writer)

    def partition(self) -> None:
        self.partitioned = True

    def heal(self) -> None:
        def reset() -> None:
            self.partitioned = False
            for w in list(self._conns):
                w.close()
            self._conns.clear()
        self.loop.call_soon_threadsafe(reset)

    def close(self) -> None:
        def stop() -> None:
            self.server.close()
            for w in list(self._conns):
                w.close()
            self.loop.stop()
        self.loop.call_soon_threadsafe(stop)
        self.thread.join(10)
