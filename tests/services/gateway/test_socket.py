"""The gateway's listening socket: bounded send buffer, and no Nagle delay on accepted connections."""
from __future__ import annotations

import socket

from pdserve.services.gateway.server import CLIENT_SNDBUF_BYTES, listen_socket


def test_accepted_connections_have_nodelay_and_bounded_sndbuf():
    lsock = listen_socket("127.0.0.1", 0)
    lsock.listen()
    client = socket.create_connection(lsock.getsockname())
    conn, _ = lsock.accept()
    try:
        assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        assert conn.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) <= 2 * CLIENT_SNDBUF_BYTES
    finally:
        for s in (conn, client, lsock):
            s.close()
