"""The gateway's failover between active-active routers (dispatch.py `_ask`): a call that finds its router dead
moves to the next, whatever concurrent calls do meanwhile (tests/e2e/test_router_failover.py is the deployment)."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.services.gateway.dispatch import Dispatcher


def _error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "connection refused")


class Router:
    def __init__(self, name: str, error: grpc.StatusCode | None = None):
        self.name, self.error, self.calls = name, error, 0

    async def Route(self, request, timeout):
        self.calls += 1
        await asyncio.sleep(0.001 * (self.calls % 3))  # answers interleave
        if self.error is not None:
            raise _error(self.error)
        return self.name


def _dispatcher(*routers: Router) -> Dispatcher:
    """Inside a running loop (its channels bind to it)."""
    d = Dispatcher(",".join(f"127.0.0.1:{9 + i}" for i in range(len(routers))), "m")
    d._routers = list(routers)
    return d


def _ask(*routers: Router):
    async def run():
        return await _dispatcher(*routers)._ask("Route", None)
    return asyncio.run(run())


def test_every_concurrent_call_reaches_the_live_router():
    """Before: the next router was counted from the shared `_primary`, which other calls had just moved onto the
    live one, so a call could try the dead router twice and fail (1 in ~400 requests under load)."""
    dead, live = Router("dead", grpc.StatusCode.UNAVAILABLE), Router("live")

    async def run():
        d = _dispatcher(dead, live)
        return await asyncio.gather(*(d._ask("Route", None) for _ in range(50))), d._primary

    answers, primary = asyncio.run(run())
    assert answers == ["live"] * 50 and primary == 1  # later calls start at the live one


def test_a_hung_router_is_replaced_and_a_refusal_is_not():
    assert _ask(Router("hung", grpc.StatusCode.DEADLINE_EXCEEDED), Router("live")) == "live"
    with pytest.raises(grpc.aio.AioRpcError) as e:
        _ask(Router("refuses", grpc.StatusCode.INVALID_ARGUMENT), Router("live"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_all_down_raises_the_last_error():
    with pytest.raises(grpc.aio.AioRpcError):
        _ask(Router("a", grpc.StatusCode.UNAVAILABLE), Router("b", grpc.StatusCode.UNAVAILABLE))
