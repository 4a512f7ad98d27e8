"""Proof of the path on the workers: each KV pull's bytes travel back to the gateway in the decode worker's first
message (`StageTimes.kv_bytes`), and the decode worker counts them per prefill peer (bytes, seconds, failures,
expired leases), with vLLM's `nixl_*` names under `--metrics-compat vllm`, and says which transport it was
configured with (`pdserve_kv_transport_info`).

Real worker processes, real gRPC, real NIXL READs over UCX's TCP transport (UCX_TLS=tcp). The expected bytes are
the prefill worker's: the blocks its KvHandle names that hold the prompt, times the block size its handshake
reports, not the decode worker's own count.
"""
import asyncio
import math
import re
import time
import urllib.request

from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer.agent import TransferFailure
from pdserve.kv_transfer.layout import KV_PROTOCOL_VERSION
from pdserve.services.convert import params_to_pb
from pdserve.services.decode.pair_metrics import OTHER, PeerLabels
from pdserve.services.grpc_util import channel
from pdserve.services.pb import worker_pb2, worker_pb2_grpc
from pdserve.services.ports import free_port
from tests.services._workers import start_worker, stop_worker, wait_serving

PARAMS = params_to_pb(SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
TCP = {"UCX_TLS": "tcp"}


def _scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def _sample(text: str, name: str, **labels: str) -> float | None:
    for m in re.finditer(rf"^{re.escape(name)}{{([^}}]*)}} (\S+)$", text, re.M):
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if all(have.get(k) == v for k, v in labels.items()):
            return float(m.group(2))
    return None


def test_pull_bytes_travel_back_and_are_counted_per_peer(tiny_llama):
    pport, dmet = free_port(), free_port()
    prefill, _ = start_worker(tiny_llama, "prefill", port=pport, env=TCP)
    decode, dport = start_worker(tiny_llama, "decode", "--metrics-port", str(dmet), "--metrics-compat", "vllm",
                                 env=TCP)
    peer = f"prefill-{pport}"
    try:
        async def main():
            await asyncio.gather(wait_serving(pport), wait_serving(dport))
            ps = worker_pb2_grpc.WorkerStub(channel(f"127.0.0.1:{pport}"))
            ds = worker_pb2_grpc.WorkerStub(channel(f"127.0.0.1:{dport}"))
            hs = await ps.KvHandshake(worker_pb2.KvHandshakeRequest(protocol_version=KV_PROTOCOL_VERSION))
            prompt = list(range(3, 80))
            pre = await ps.Prefill(worker_pb2.PrefillRequest(request_id="a", prompt_token_ids=prompt, params=PARAMS))
            want = math.ceil(pre.kv.num_tokens / hs.region.layout.block_size) * hs.region.layout.block_bytes
            msgs = [m async for m in ds.GenerateFromPrefill(worker_pb2.GenerateFromPrefillRequest(
                request_id="a", prompt_token_ids=prompt, params=PARAMS, first_tokens=pre.first_tokens, kv=pre.kv))]
            assert msgs[-1].state == "FINISHED", msgs[-1]
            t = msgs[0].times
            assert t.kv_bytes == want > 0 and t.kv_transfer_end >= t.kv_transfer_start > 0
            # the prefill side's lease already gone when the READ would start: a failure of this pair
            pre = await ps.Prefill(worker_pb2.PrefillRequest(request_id="b", prompt_token_ids=prompt[::-1],
                                                             params=PARAMS))
            pre.kv.lease_expiry_unix = time.time() - 1
            msgs = [m async for m in ds.GenerateFromPrefill(worker_pb2.GenerateFromPrefillRequest(
                request_id="b", prompt_token_ids=prompt[::-1], params=PARAMS, first_tokens=pre.first_tokens,
                kv=pre.kv))]
            assert msgs[-1].state == "FAILED" and msgs[-1].retryable, msgs[-1]
            return want, t.kv_transfer_end - t.kv_transfer_start

        want, took = asyncio.run(main())
        # the transport self-test the pair's first pull started (kv_transfer/probe.py), in the background
        end = time.monotonic() + 15
        while _sample(_scrape(dmet), "pdserve_kv_pair_probe_bytes_per_second", peer=peer) is None:
            assert time.monotonic() < end, "no transport self-test within 15 s of the pair's first pull"
            time.sleep(0.2)
        text = _scrape(dmet)
        assert 0 < _sample(text, "pdserve_kv_pair_probe_latency_seconds", peer=peer) < 5
        assert _sample(text, "pdserve_kv_pair_probe_bytes_per_second", peer=peer) > 0
        assert _sample(text, "pdserve_kv_pair_transfer_bytes_sum", peer=peer) == want
        assert _sample(text, "pdserve_kv_pair_transfer_bytes_count", peer=peer) == 1
        assert _sample(text, "pdserve_kv_pair_transfer_seconds_count", peer=peer) == 1
        assert 0 < _sample(text, "pdserve_kv_pair_transfer_seconds_sum", peer=peer) <= took
        assert _sample(text, "pdserve_kv_pair_failures_total", peer=peer, reason="lease_expired") == 1
        assert _sample(text, "pdserve_kv_pair_leases_expired_total", peer=peer) == 1
        assert _sample(text, "pdserve_kv_transport_info", backend="UCX", transport="tcp", source="configured") == 1
        # vLLM's names, from the same samples
        assert _sample(text, "vllm:nixl_bytes_transferred_sum", peer=peer) == want
        assert _sample(text, "vllm:nixl_xfer_time_seconds_count", peer=peer) == 1
        assert _sample(text, "vllm:nixl_num_failed_transfers_total", peer=peer, reason="lease_expired") == 1
    finally:
        for p in (prefill, decode):
            stop_worker(p)


def test_peer_labels_are_capped():
    lbl = PeerLabels(cap=2)
    assert [lbl("p1"), lbl("p2"), lbl("p3"), lbl("p1"), lbl("")] == ["p1", "p2", OTHER, "p1", OTHER]
    assert TransferFailure.LEASE_EXPIRED.value == "lease_expired"


def test_the_self_test_feeds_the_router_bandwidth():
    from pdserve.services.load_meter import LoadMeter
    m = LoadMeter()
    assert m.report().kv_bytes_per_s == 0  # no measurement: the router keeps its prior
    m.observe_probe(5e6)
    assert m.report().kv_bytes_per_s == 5e6
