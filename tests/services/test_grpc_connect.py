"""How long one connection attempt on an internal channel may take (grpc_util.CONNECT_TIMEOUT_MS).

The reproduction: CI's chart test with mTLS got 503 on its first request because the gateway's first connection to
a decode worker, a TLS handshake on a loaded host, did not finish in the 100 ms gRPC was given ("connection attempt
timed out before receiving SETTINGS frame"). Here a proxy holds each new connection's bytes for 400 ms, as a slow
handshake would: a call without wait_for_ready must still succeed. And a peer that accepts and never answers must
still fail the call UNAVAILABLE within a few seconds, not after gRPC's default 20 s, so requests fail over."""
from __future__ import annotations

import asyncio
import socket
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.services import grpc_util


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


async def _slow_proxy(target_port: int, hold_s: float) -> tuple[asyncio.Server, int]:
    """Accepts at once, then forwards nothing either way for `hold_s` (the handshake's first bytes wait)."""
    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        await asyncio.sleep(hold_s)
        ur, uw = await asyncio.open_connection("127.0.0.1", target_port)
        await asyncio.gather(_pipe(cr, uw), _pipe(ur, cw))

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    return srv, srv.sockets[0].getsockname()[1]


async def _check(port: int, timeout: float) -> float:
    t0 = time.monotonic()
    async with grpc_util.channel(f"127.0.0.1:{port}") as ch:
        await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
    return time.monotonic() - t0


def test_a_connection_slower_than_100ms_still_serves_the_first_call():
    async def main() -> float:
        server, hs = grpc_util.make_server([])
        port = grpc_util.listen(server, "127.0.0.1:0")
        await server.start()
        proxy, pport = await _slow_proxy(port, 0.4)
        try:
            return await _check(pport, timeout=10)
        finally:
            proxy.close()
            await server.stop(None)

    took = asyncio.run(main())
    assert 0.4 <= took < 5, took


def test_a_peer_that_never_answers_fails_the_call_within_the_connect_timeout():
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # the kernel completes the TCP handshake; nothing ever reads or writes
    try:
        t0 = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            asyncio.run(_check(silent.getsockname()[1], timeout=30))
        took = time.monotonic() - t0
    finally:
        silent.close()
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value
    assert grpc_util.CONNECT_TIMEOUT_MS / 1000 * 0.9 <= took < grpc_util.CONNECT_TIMEOUT_MS / 1000 + 3, took
