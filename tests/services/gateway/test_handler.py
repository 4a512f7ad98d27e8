"""RequestHandler's placement before admission (handler._placement)."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from pdserve.engine.sampling_params import SamplingParams
from pdserve.services.admission import Admission
from pdserve.services.gateway.handler import RequestHandler
from pdserve.services.pb import common_pb2, router_pb2


class _Dispatcher:
    def __init__(self):
        self.routed = 0

    async def route(self, *a, **k):
        self.routed += 1
        return router_pb2.RouteResponse(mode="colocated", cached_tokens=16,
                                        both=common_pb2.WorkerInfo(worker_id="w-0"))


def _placement(queued: int, max_queue: int = 3):
    admission = Admission(ledger=None, capacity_fn=None, max_queue=max_queue)
    admission.queued = queued
    disp = _Dispatcher()
    h = RequestHandler(SimpleNamespace(admission=admission), disp, 2048)
    rec = SimpleNamespace(tenant=SimpleNamespace(namespace="t"))
    call = SimpleNamespace(prompts=[list(range(40))], params=SamplingParams(max_tokens=4))
    return asyncio.run(h._placement(rec, "r1", call)), disp.routed


def test_placement_asks_the_router_and_brings_the_hit_while_the_queue_has_room():
    (route, hit), routed = _placement(queued=2)
    assert routed == 1 and route.both.worker_id == "w-0"
    assert hit is not None and hit.worker_id == "w-0" and hit.cached_tokens == 16


def test_a_full_queue_skips_the_router_call_before_admission():
    """At a full queue a request that does not fit is rejected at once: it must not wait for a router round trip
    first (the rejection-latency bound of tests/e2e/test_overload.py); admission then judges it on the whole
    prompt, which never admits more than the hit would."""
    (route, hit), routed = _placement(queued=3)
    assert (route, hit, routed) == (None, None, 0)
