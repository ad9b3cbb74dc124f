"""The API server's connections have Nagle's algorithm off: asyncio (under
uvicorn) sets TCP_NODELAY on the connections of a listener only when the
socket object says it is TCP. With it on, every response after the first on a
kept-alive connection waited ~40 ms for the client's delayed ACK."""
from __future__ import annotations

import asyncio
import os
import socket

from fleet.core.ipc import listening_socket
from fleet.frontend.api_server import inherited_listener


def nodelay_of_accepted_connection(listener: socket.socket) -> int:
    async def accept_one() -> int:
        accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                sock = transport.get_extra_info("socket")
                accepted.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Probe, sock=listener)
        _, writer = await asyncio.open_connection(*listener.getsockname()[:2])
        try:
            return await asyncio.wait_for(accepted, timeout=10)
        finally:
            writer.close()
            server.close()

    return asyncio.run(accept_one())


def test_connections_of_the_inherited_listener_have_nodelay():
    bound = listening_socket("127.0.0.1", 0)
    try:
        listener = inherited_listener(os.dup(bound.fileno()))  # what an API server receives
        assert listener.family == socket.AF_INET and listener.proto == socket.IPPROTO_TCP
        assert nodelay_of_accepted_connection(listener) != 0
    finally:
        bound.close()
