"""Which path served a request (gateway/path.py): the header and counter's classification, and --require-disagg
refusing a request the router would prefill on its decoding worker."""
from __future__ import annotations

import asyncio

import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.services.gateway.dispatch import Dispatcher, split
from pdserve.services.gateway.errors import reply_for
from pdserve.services.gateway.path import DisaggUnavailable, PathHeader, header, path_of
from pdserve.services.pb import common_pb2, router_pb2


@pytest.mark.parametrize("mode, reason, path", [
    ("disagg", "disagg_faster", "disagg"), ("disagg", "disagg_forced", "disagg"),
    ("colocated", "local_faster", "local"), ("colocated", "colocated_only", "local"),
    ("colocated", "round_robin", "local"),
    ("colocated", "degraded_no_prefill", "fallback"), ("colocated", "degraded_prefill_unreachable", "fallback"),
])
def test_path_of(mode, reason, path):
    assert path_of(mode, reason) == path
    assert header(mode, reason) == f"{path}; reason={reason}"


def _colocated(reason: str) -> router_pb2.RouteResponse:
    return router_pb2.RouteResponse(mode="colocated", reason=reason,
                                    both=common_pb2.WorkerInfo(worker_id="d-0", address="127.0.0.1:9"))


@pytest.mark.parametrize("required", [True, False])
def test_require_disagg_refuses_a_local_placement(required):
    async def run():
        d = Dispatcher("127.0.0.1:9", "m", max_attempts=1, require_disagg=required)

        async def route(*a, **k):
            return _colocated("degraded_no_prefill")

        d.route = route
        sub = split([[1, 2, 3]], SamplingParams(max_tokens=2))[0]
        return [m async for m in d.generate("r1", sub)]

    if required:
        with pytest.raises(DisaggUnavailable) as e:
            asyncio.run(run())
        r = reply_for(e.value)
        assert (r.status, r.code, r.state) == (503, "disagg_unavailable", "REJECTED")
        assert "degraded_no_prefill" in r.message
    else:  # not required: it goes to the worker (none listens on :9: the request ends FAILED, naming it)
        last = asyncio.run(run())[-1]
        assert last.finished and last.state == "FAILED" and "d-0" in last.error


def test_a_whole_answer_names_its_last_placement():
    """A disaggregated placement whose KV pull failed, placed again on one worker (a migration that prefills
    where it decodes), is a fallback on the answer, not `disagg` (found cutting decode -> prefill on emulated
    hosts: docs/lab.md)."""
    headers: dict[str, str] = {}
    p = PathHeader(1, headers)
    p.place("disagg", "disagg_forced")
    assert headers["x-pdserve-path"] == "disagg; reason=disagg_forced"
    p.place("colocated", "local_faster")
    assert headers["x-pdserve-path"] == "fallback; reason=local_faster; placements=2"
    p.place("disagg", "disagg_faster")  # a retry on another pair before anything was emitted
    assert headers["x-pdserve-path"] == "disagg; reason=disagg_faster; placements=3"


def test_local_stays_local_without_a_disaggregated_placement_and_several_prompts_keep_the_first():
    headers: dict[str, str] = {}
    p = PathHeader(1, headers)
    p.place("colocated", "colocated_only")
    p.place("colocated", "colocated_only")
    assert headers["x-pdserve-path"] == "local; reason=colocated_only; placements=2"
    many: dict[str, str] = {}
    q = PathHeader(2, many)
    q.place("disagg", "disagg_faster")
    q.place("colocated", "local_faster")
    assert many["x-pdserve-path"] == "disagg; reason=disagg_faster"
