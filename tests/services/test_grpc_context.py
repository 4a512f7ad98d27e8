"""pdserve/services/grpc_context.py over real gRPC (in-process servers on loopback, the channels and servers
grpc_util makes): the caller's request id reaches unary and streaming handlers and the calls they make in turn;
a front-door service replaces a missing or unacceptable id and echoes it; an inner service trusts no bad id;
each served RPC leaves one access line with its status."""
from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from pdserve.services import logs
from pdserve.services.grpc_context import ContextServerInterceptor
from pdserve.services.grpc_util import channel


def _ident(b):
    return b


class Servers:
    """`inner` (test.Inner: Id, Ids) and `front` (test.Front: Relay, which calls inner's Ids)."""

    async def start(self):
        self.inner = grpc.aio.server(interceptors=[ContextServerInterceptor()])

        async def id_(request, context):
            return logs.request_id.get().encode()

        async def ids(request, context):
            if request == b"abort":
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no")
            for _ in range(2):
                await asyncio.sleep(0)
                yield logs.request_id.get().encode()

        self.inner.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Inner", {
            "Id": grpc.unary_unary_rpc_method_handler(id_, _ident, _ident),
            "Ids": grpc.unary_stream_rpc_method_handler(ids, _ident, _ident)})])
        inner_port = self.inner.add_insecure_port("127.0.0.1:0")
        await self.inner.start()
        self.inner_ch = channel(f"127.0.0.1:{inner_port}")

        self.front = grpc.aio.server(interceptors=[ContextServerInterceptor("test.Front")])
        inner_ids = self.inner_ch.unary_stream("/test.Inner/Ids", _ident, _ident)

        async def relay(request, context):
            # what the front door's handler sees, then what the inner service saw, from a separate task too
            yield logs.request_id.get().encode()
            async for m in inner_ids(b""):
                yield m
            yield await asyncio.create_task(self.call_id())

        self.front.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Front", {
            "Relay": grpc.unary_stream_rpc_method_handler(relay, _ident, _ident)})])
        front_port = self.front.add_insecure_port("127.0.0.1:0")
        await self.front.start()
        self.front_ch = channel(f"127.0.0.1:{front_port}")
        return self

    async def call_id(self) -> bytes:
        return await self.inner_ch.unary_unary("/test.Inner/Id", _ident, _ident)(b"")

    async def stop(self):
        await self.front_ch.close()
        await self.inner_ch.close()
        await self.front.stop(None)
        await self.inner.stop(None)


def run(coro_fn):
    async def main():
        s = await Servers().start()
        try:
            return await coro_fn(s)
        finally:
            await s.stop()
    return asyncio.run(main())


def test_caller_id_reaches_unary_and_streaming_handlers():
    async def go(s):
        logs.request_id.set("caller-1")
        one = await s.inner_ch.unary_unary("/test.Inner/Id", _ident, _ident)(b"")
        many = [m async for m in s.inner_ch.unary_stream("/test.Inner/Ids", _ident, _ident)(b"")]
        # and from a task the caller starts (the interceptor runs in the caller's copied context)
        later = await asyncio.create_task(s.call_id())
        return one, many, later
    assert run(go) == (b"caller-1", [b"caller-1", b"caller-1"], b"caller-1")


def test_no_id_on_an_inner_service_stays_none_and_a_bad_one_is_not_trusted():
    async def go(s):
        plain = await s.inner_ch.unary_unary("/test.Inner/Id", _ident, _ident)(b"")
        bad = await s.inner_ch.unary_unary("/test.Inner/Id", _ident, _ident)(
            b"", metadata=(("x-request-id", "bad id"),))
        return plain, bad
    assert run(go) == (logs.NO_ID.encode(), logs.NO_ID.encode())


@pytest.mark.parametrize("given,kept", [("client-7", True), (None, False), ("not ok!", False), ("x" * 200, False)])
def test_front_door_accepts_or_replaces_echoes_and_propagates(given, kept):
    async def go(s):
        md = (("x-request-id", given),) if given is not None else ()
        call = s.front_ch.unary_stream("/test.Front/Relay", _ident, _ident)(b"", metadata=md)
        got = [m.decode() async for m in call]
        return got, dict(await call.initial_metadata()), dict(await call.trailing_metadata())

    got, initial, trailing = run(go)
    rid = initial["x-request-id"]
    assert trailing["x-request-id"] == rid
    assert rid == given if kept else (rid != given and logs.valid_request_id(rid) == rid)
    assert got == [rid] * 4  # the front handler, the inner stream's two messages, the inner unary from a task


def test_access_lines_name_method_status_and_id(caplog):
    async def go(s):
        logs.request_id.set("acc-1")
        await s.inner_ch.unary_unary("/test.Inner/Id", _ident, _ident)(b"")
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in s.inner_ch.unary_stream("/test.Inner/Ids", _ident, _ident)(b"abort"):
                pass
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    caplog.set_level(logging.INFO, logger="pdserve.rpc")
    caplog.handler.addFilter(logs.ContextFilter("test"))  # what logs.setup puts on the process's handler
    run(go)
    lines = [(*r.getMessage().split()[:2], r.request_id) for r in caplog.records if r.name == "pdserve.rpc"]
    assert sorted(lines) == [("/test.Inner/Id", "OK", "acc-1"), ("/test.Inner/Ids", "INVALID_ARGUMENT", "acc-1")]
