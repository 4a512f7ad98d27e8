"""Standalone worker processes (real gRPC + NIXL): a decode worker refuses KV from a prefill worker whose layout
differs, with an error naming the field, and both stay healthy; health + reflection are served."""
import asyncio
import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdserve.engine.sampling_params import SamplingParams
from pdserve.services.convert import params_to_pb
from pdserve.services.grpc_util import channel
from pdserve.services.pb import worker_pb2, worker_pb2_grpc
from tests.conftest import make_checkpoint
from tests.services._workers import start_worker, wait_serving


@pytest.fixture(scope="module")
def mismatched(tmp_path_factory, tiny_llama):
    # same model family and block size, but 4 KV heads instead of 2: blocks mean something else
    other = make_checkpoint(tmp_path_factory.mktemp("other"), "llama", kv_heads=4)
    procs = [start_worker(tiny_llama, "prefill"), start_worker(other, "decode")]
    yield [port for _, port in procs]
    for p, _ in procs:
        p.send_signal(signal.SIGTERM)
    for p, _ in procs:
        assert p.wait(30) == 0  # SIGTERM drains and exits cleanly


def test_layout_mismatch_refused_with_clear_error(mismatched):
    pport, dport = mismatched

    async def main():
        await asyncio.gather(wait_serving(pport), wait_serving(dport))
        ps = worker_pb2_grpc.WorkerStub(channel(f"127.0.0.1:{pport}"))
        ds = worker_pb2_grpc.WorkerStub(channel(f"127.0.0.1:{dport}"))
        sp = params_to_pb(SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        prompt = list(range(2, 30))
        pre = await ps.Prefill(worker_pb2.PrefillRequest(request_id="m1", prompt_token_ids=prompt, params=sp))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in ds.GenerateFromPrefill(worker_pb2.GenerateFromPrefillRequest(
                    request_id="m1", prompt_token_ids=prompt, params=sp, first_tokens=pre.first_tokens,
                    kv=pre.kv)):
                pass
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        msg = e.value.details()
        assert "num_kv_heads" in msg and "fingerprint" in msg and "block_size" not in msg, msg
        # both sides are clean and healthy afterwards: the decode worker told the prefill worker to release
        for stub, port in ((ps, pport), (ds, dport)):
            await wait_serving(port, 5)
            for _ in range(50):
                st = await stub.GetStats(worker_pb2.GetStatsRequest())
                if st.load.kv_blocks_in_use == 0:
                    break
                await asyncio.sleep(0.1)
            assert st.load.kv_blocks_in_use == 0
        # reflection lists the services
        rs = reflection_pb2_grpc.ServerReflectionStub(channel(f"127.0.0.1:{dport}"))

        async def reqs():
            yield reflection_pb2.ServerReflectionRequest(list_services="")

        async for resp in rs.ServerReflectionInfo(reqs()):
            names = {s.name for s in resp.list_services_response.service}
            assert {"pdserve.v1.Worker", "grpc.health.v1.Health"} <= names
            break

    asyncio.run(main())


def test_sigterm_drains_in_flight_stream(tiny_llama):
    """SIGTERM while a stream is running: health goes NOT_SERVING, the stream still completes, exit code 0."""
    p, port = start_worker(tiny_llama, "both")

    async def main():
        await wait_serving(port)
        stub = worker_pb2_grpc.WorkerStub(channel(f"127.0.0.1:{port}"))
        health = health_pb2_grpc.HealthStub(channel(f"127.0.0.1:{port}"))
        sp = params_to_pb(SamplingParams(temperature=0, max_tokens=300, ignore_eos=True))
        n, last, signalled = 0, None, False
        async for m in stub.Generate(worker_pb2.GenerateRequest(request_id="d1", prompt_token_ids=[2, 3, 4],
                                                                params=sp)):
            n += sum(len(o.token_ids) for o in m.outputs)
            last = m
            if not signalled:
                p.send_signal(signal.SIGTERM)
                signalled = True
                for _ in range(50):
                    st = (await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)).status
                    if st == health_pb2.HealthCheckResponse.NOT_SERVING:
                        break
                    await asyncio.sleep(0.05)
                assert st == health_pb2.HealthCheckResponse.NOT_SERVING
        assert last.finished and last.state == "FINISHED" and n == 300

    try:
        asyncio.run(main())
        assert p.wait(30) == 0
    finally:
        if p.poll() is None:
            p.kill()


def test_transfer_from_dead_prefill_worker_fails_cleanly(tiny_llama):
    """The prefill worker dies (kill -9) after Prefill: the decode worker's pull fails, the request ends FAILED,
    the decode worker frees its blocks, stays SERVING and serves the next request."""
    (pp, pport), (dp, dport) = start_worker(tiny_llama, "prefill"), start_worker(tiny_llama, "decode")
    (bp, bport) = start_worker(tiny_llama, "prefill")

    async def main():
        await asyncio.gather(wait_serving(pport), wait_serving(dport), wait_serving(bport))
        sp = params_to_pb(SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        prompt = list(range(2, 40))
        ds = worker_pb2_grpc.WorkerStub(channel(f"127.0.0.1:{dport}"))
        pre = await worker_pb2_grpc.WorkerStub(channel(f"127.0.0.1:{pport}")).Prefill(
            worker_pb2.PrefillRequest(request_id="x1", prompt_token_ids=prompt, params=sp))
        pp.kill()
        pp.wait()
        msgs = [m async for m in ds.GenerateFromPrefill(worker_pb2.GenerateFromPrefillRequest(
            request_id="x1", prompt_token_ids=prompt, params=sp, first_tokens=pre.first_tokens, kv=pre.kv))]
        assert msgs[-1].finished and msgs[-1].state == "FAILED" and "transfer" in msgs[-1].error
        assert (await ds.GetStats(worker_pb2.GetStatsRequest())).load.kv_blocks_in_use == 0
        await wait_serving(dport, 5)
        # the same decode worker then serves a request prefilled by a live worker
        pre = await worker_pb2_grpc.WorkerStub(channel(f"127.0.0.1:{bport}")).Prefill(
            worker_pb2.PrefillRequest(request_id="x2", prompt_token_ids=prompt, params=sp))
        msgs = [m async for m in ds.GenerateFromPrefill(worker_pb2.GenerateFromPrefillRequest(
            request_id="x2", prompt_token_ids=prompt, params=sp, first_tokens=pre.first_tokens, kv=pre.kv))]
        assert msgs[-1].state == "FINISHED" and sum(len(o.token_ids) for m in msgs for o in m.outputs) == 8

    try:
        asyncio.run(main())
    finally:
        for p in (pp, dp, bp):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in (dp, bp):
            assert p.wait(30) == 0
