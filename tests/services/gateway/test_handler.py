"""RequestHandler's placement before admission (handler._placement)."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

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


@pytest.mark.parametrize("queued,max_queue", [(2, 3), (0, 0), (3, 3)])
def test_placement_asks_the_router_and_brings_the_hit_whatever_the_queue(queued, max_queue):
    """Also with no room to queue: a request is then admitted only if it fits at once, and its hit decides that
    (tests/e2e/test_admission_prefix_hits.py: four requests behind a cached prefix under `--admission-queue 0`)."""
    (route, hit), routed = _placement(queued, max_queue)
    assert routed == 1 and route.both.worker_id == "w-0"
    assert hit is not None and hit.worker_id == "w-0" and hit.cached_tokens == 16

