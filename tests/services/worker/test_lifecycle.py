"""Lifecycle limits travel as proto fields (`Lifecycle` in GenerateRequest / PrefillRequest /
GenerateFromPrefillRequest), not gRPC metadata: real worker processes obey a deadline they are given only that way.

Every engine step is slowed to 50 ms (the PDSERVE_FAULT_STEP_DELAY_S fault injection), so 48 tokens take ~2.4 s;
a deadline 0.6 s away must end the request TIMED_OUT with fewer tokens, and the same request without a
Lifecycle must run to the end (so the deadline, nothing else, cut it short).
"""
import asyncio
import signal
import time

import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.services.convert import lifecycle_to_pb, params_to_pb
from pdserve.services.grpc_util import channel
from pdserve.services.pb import worker_pb2, worker_pb2_grpc
from tests.services._workers import start_worker, wait_serving

MAX_TOKENS = 48
SLOW = {"PDSERVE_FAULT_STEP_DELAY_S": "0.05"}


@pytest.fixture(scope="module")
def workers(tiny_llama):
    procs = {role: start_worker(tiny_llama, role, env=SLOW) for role in ("both", "prefill", "decode")}

    async def ready():
        await asyncio.gather(*(wait_serving(port) for _, port in procs.values()))

    try:
        asyncio.run(ready())
        yield {role: port for role, (_, port) in procs.items()}
    finally:
        for p, _ in procs.values():
            p.send_signal(signal.SIGTERM)
        for p, _ in procs.values():
            assert p.wait(30) == 0


PROMPT = list(range(2, 30))
PARAMS = params_to_pb(SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))


def _stub(port: int) -> worker_pb2_grpc.WorkerStub:
    return worker_pb2_grpc.WorkerStub(channel(f"127.0.0.1:{port}"))


def _ntok(msgs) -> int:
    return sum(len(o.token_ids) for m in msgs for o in m.outputs)


def test_colocated_worker_obeys_a_proto_deadline(workers):
    async def main():
        both = _stub(workers["both"])
        free = [m async for m in both.Generate(worker_pb2.GenerateRequest(
            request_id="free", prompt_token_ids=PROMPT, params=PARAMS))]
        assert free[-1].state == "FINISHED" and _ntok(free) == MAX_TOKENS
        t0 = time.time()
        msgs = [m async for m in both.Generate(worker_pb2.GenerateRequest(
            request_id="dl", prompt_token_ids=PROMPT, params=PARAMS,
            lifecycle=lifecycle_to_pb(t0 + 0.6, 0, MAX_TOKENS)))]
        assert msgs[-1].finished and msgs[-1].state == "TIMED_OUT", msgs[-1]
        assert 0 < _ntok(msgs) < MAX_TOKENS
        assert time.time() - t0 < 2.0  # ended at the deadline, not at the end of the output

    asyncio.run(main())


def test_disaggregated_workers_obey_a_proto_deadline(workers):
    async def main():
        ps, ds = _stub(workers["prefill"]), _stub(workers["decode"])
        # the prefill worker: a deadline already passed ends it there, nothing handed over
        pre = await ps.Prefill(worker_pb2.PrefillRequest(
            request_id="late", prompt_token_ids=PROMPT, params=PARAMS,
            lifecycle=lifecycle_to_pb(time.time() - 1, None, None)))
        assert pre.finished and pre.final.state == "TIMED_OUT" and not pre.HasField("kv"), pre
        # the decode worker: the deadline cuts the stream short
        lc = lifecycle_to_pb(time.time() + 1.0, 0, MAX_TOKENS)
        pre = await ps.Prefill(worker_pb2.PrefillRequest(request_id="dd", prompt_token_ids=PROMPT, params=PARAMS,
                                                         lifecycle=lc))
        assert not pre.finished
        msgs = [m async for m in ds.GenerateFromPrefill(worker_pb2.GenerateFromPrefillRequest(
            request_id="dd", prompt_token_ids=PROMPT, params=PARAMS, first_tokens=pre.first_tokens,
            kv=pre.kv, lifecycle=lc))]
        assert msgs[-1].state == "TIMED_OUT", msgs[-1]
        assert 0 < _ntok(msgs) < MAX_TOKENS
        # without a Lifecycle the same hand-off runs to the end
        pre = await ps.Prefill(worker_pb2.PrefillRequest(request_id="df", prompt_token_ids=PROMPT, params=PARAMS))
        msgs = [m async for m in ds.GenerateFromPrefill(worker_pb2.GenerateFromPrefillRequest(
            request_id="df", prompt_token_ids=PROMPT, params=PARAMS, first_tokens=pre.first_tokens,
            kv=pre.kv))]
        assert msgs[-1].state == "FINISHED" and _ntok(msgs) == MAX_TOKENS

    asyncio.run(main())
