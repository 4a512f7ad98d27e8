"""The versioned KV handshake: a decode worker learns a prefill worker's NIXL region once per peer incarnation,
not from every PrefillResponse.

Real worker processes, real gRPC, real NIXL READs. The handshakes are counted on both sides from their
Prometheus endpoints (`pdserve_kv_handshakes_total{side}`), and the region's agent metadata is checked to be
absent from the PrefillResponse bytes. A prefill worker restarted on the same address (same worker id, so the
same NIXL agent name, new incarnation) makes the decode worker shake hands again and the hand-off still serves
the same tokens. A worker speaking another protocol version is refused with FAILED_PRECONDITION.
"""
import asyncio
import re
import signal
import time
import urllib.request

import grpc
import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer.layout import KV_PROTOCOL_VERSION
from pdserve.services.convert import params_to_pb
from pdserve.services.grpc_util import channel
from pdserve.services.pb import worker_pb2, worker_pb2_grpc
from pdserve.services.ports import free_port
from tests.services._workers import start_worker, wait_serving

PARAMS = params_to_pb(SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))


def _handshakes(metrics_port: int, side: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    # the process labels (model, role) come first in the sample's label set
    m = re.search(rf'^pdserve_kv_handshakes_total{{[^}}]*\bside="{side}"[^}}]*}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def _stop(p) -> None:
    p.send_signal(signal.SIGTERM)
    assert p.wait(30) == 0


async def _restart_on(model, port: int, *args: str):
    """Start a prefill worker again on `port` and wait until it serves. Another process may hold that port for a
    moment: the decode worker keeps reconnecting to the dead address, and a loopback connect to a free port in the
    ephemeral range can end up bound to that very port (TCP self-connect) until gRPC drops it. So a worker that
    exits on a failed bind is started again, not a test failure."""
    for _ in range(10):
        p, _ = start_worker(model, "prefill", *args, port=port)
        end = time.monotonic() + 120
        while p.poll() is None and time.monotonic() < end:
            try:
                await wait_serving(port, timeout=1)
                return p
            except TimeoutError:
                pass
        if p.poll() is None:
            p.kill()
            raise AssertionError(f"prefill worker on {port} not serving")
        await asyncio.sleep(0.5)
    raise AssertionError(f"no prefill worker could bind 127.0.0.1:{port} again")


async def _handoff(ps, ds, rid: str, prompt: list[int]):
    pre = await ps.Prefill(worker_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt, params=PARAMS))
    assert not pre.finished and pre.kv.incarnation
    msgs = [m async for m in ds.GenerateFromPrefill(worker_pb2.GenerateFromPrefillRequest(
        request_id=rid, prompt_token_ids=prompt, params=PARAMS, first_tokens=pre.first_tokens, kv=pre.kv))]
    assert msgs[-1].state == "FINISHED", msgs[-1]
    return pre, [t for m in msgs for o in m.outputs for t in o.token_ids]


def test_handshake_once_per_peer_incarnation(tiny_llama):
    pport, pmet, dmet = free_port(), free_port(), free_port()
    prefill, _ = start_worker(tiny_llama, "prefill", "--metrics-port", str(pmet), port=pport)
    decode, dport = start_worker(tiny_llama, "decode", "--metrics-port", str(dmet))
    try:
        async def main():
            await asyncio.gather(wait_serving(pport), wait_serving(dport))
            ps = worker_pb2_grpc.WorkerStub(channel(f"127.0.0.1:{pport}"))
            ds = worker_pb2_grpc.WorkerStub(channel(f"127.0.0.1:{dport}"))
            a, b = list(range(2, 60)), list(range(100, 140))
            pre_a, toks_a = await _handoff(ps, ds, "a", a)
            pre_b, toks_b = await _handoff(ps, ds, "b", b)
            assert pre_a.kv.incarnation == pre_b.kv.incarnation
            assert _handshakes(dmet, "initiated") == 1 and _handshakes(pmet, "served") == 1
            # the region itself travels only in the handshake (asked here directly: one more "served")
            hs = await ps.KvHandshake(worker_pb2.KvHandshakeRequest(protocol_version=KV_PROTOCOL_VERSION))
            md = hs.region.agent_metadata
            assert len(md) > 64 and hs.incarnation == pre_a.kv.incarnation
            assert md not in pre_a.SerializeToString() and len(pre_a.SerializeToString()) < len(md)
            return toks_a, pre_a.kv.incarnation

        toks_a, inc1 = asyncio.run(main())
        _stop(prefill)
        prefill = None

        async def after_restart():
            nonlocal prefill
            prefill = await _restart_on(tiny_llama, pport, "--metrics-port", str(pmet))
            ps = worker_pb2_grpc.WorkerStub(channel(f"127.0.0.1:{pport}"))
            ds = worker_pb2_grpc.WorkerStub(channel(f"127.0.0.1:{dport}"))
            pre, toks = await _handoff(ps, ds, "c", list(range(200, 250)))
            assert pre.kv.incarnation != inc1
            assert _handshakes(dmet, "initiated") == 2 and _handshakes(pmet, "served") == 1
            _, toks_a2 = await _handoff(ps, ds, "a2", list(range(2, 60)))
            assert toks_a2 == toks_a  # greedy: the KV pulled from the new process means the same
            assert _handshakes(dmet, "initiated") == 2

        asyncio.run(after_restart())
    finally:
        for p in (prefill, decode):
            if p is not None and p.poll() is None:
                _stop(p)


def test_protocol_version_mismatch_is_failed_precondition(tiny_llama):
    prefill, pport = start_worker(tiny_llama, "prefill")
    decode, dport = start_worker(tiny_llama, "decode", env={"PDSERVE_FAULT_KV_PROTOCOL_VERSION": "999"})
    try:
        async def main():
            await asyncio.gather(wait_serving(pport), wait_serving(dport))
            ps = worker_pb2_grpc.WorkerStub(channel(f"127.0.0.1:{pport}"))
            ds = worker_pb2_grpc.WorkerStub(channel(f"127.0.0.1:{dport}"))
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await ps.KvHandshake(worker_pb2.KvHandshakeRequest(protocol_version=KV_PROTOCOL_VERSION + 1))
            assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "version" in ei.value.details()
            prompt = list(range(2, 40))
            pre = await ps.Prefill(worker_pb2.PrefillRequest(request_id="v", prompt_token_ids=prompt, params=PARAMS))
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                async for _ in ds.GenerateFromPrefill(worker_pb2.GenerateFromPrefillRequest(
                        request_id="v", prompt_token_ids=prompt, params=PARAMS, first_tokens=pre.first_tokens,
                        kv=pre.kv)):
                    pass
            assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "version" in ei.value.details()
            # the decode worker released the prefill side's lease (nothing stays pinned) and still serves
            for _ in range(50):
                st = await ps.GetStats(worker_pb2.GetStatsRequest())
                if st.load.pinned_blocks == 0:
                    break
                await asyncio.sleep(0.1)
            assert st.load.pinned_blocks == 0

        asyncio.run(main())
    finally:
        _stop(prefill)
        _stop(decode)
