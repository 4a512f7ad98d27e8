"""Proof of the path on the workers: each KV pull's bytes travel back to the gateway in the decode worker's first
message (`StageTimes.kv_bytes`), and the decode worker counts them per prefill peer (bytes, seconds, failures,
expired leases), with vLLM's `nixl_*` names under `--metrics-compat vllm`, and says which transport it was
configured with (`pdserve_kv_transport_info`) and which one UCX chose for each peer
(`pdserve_kv_pair_transport_info`, `pdserve status`; kv_transfer/ucx_log.py).

Real worker processes, real gRPC, real NIXL READs, real Redis, one set for the module: a decode worker with UCX's
defaults (UCX_TLS unset: configured `auto`) and two prefill workers,
- one with UCX_TLS=tcp (what `pdserve lab` sets): it offers UCX nothing but TCP, so the decode worker's READs from
  it go over TCP although its own configuration allows everything. Observed: `tcp`. The byte counts are checked
  on this pair: the expected bytes are the prefill worker's (the blocks its KvHandle names that hold the prompt,
  times the block size its handshake reports), not the decode worker's own count.
- one with UCX's defaults too: between two processes of one host UCX reads through cross-memory attach, the
  bypass the lab found (the KV never crosses a network). Observed: a shared-memory kind.
An observation that echoed the configuration says `auto` for both and fails; one that guessed from the host (one
host: shared memory) fails the first; one that did not tell the peers apart fails one of the two.
"""
import asyncio
import math
import re
import time
import urllib.request
import uuid

import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer.agent import TransferFailure
from pdserve.kv_transfer.layout import KV_PROTOCOL_VERSION
from pdserve.services import status
from pdserve.services.convert import params_to_pb
from pdserve.services.decode.pair_metrics import OTHER, PeerLabels
from pdserve.services.grpc_util import channel
from pdserve.services.pb import worker_pb2, worker_pb2_grpc
from pdserve.services.ports import free_port
from pdserve.services.redis_conn import NO_AUTH
from tests.services._workers import start_worker, stop_worker, wait_serving

PARAMS = params_to_pb(SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
TCP = {"UCX_TLS": "tcp"}
REDIS = "redis://127.0.0.1:6379/0"
SHM = {"cma", "posix", "sysv", "xpmem", "knem"}  # UCX's transports within one host (shared memory, CMA)


def _scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def _sample(text: str, name: str, **labels: str) -> float | None:
    for m in re.finditer(rf"^{re.escape(name)}{{([^}}]*)}} (\S+)$", text, re.M):
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if all(have.get(k) == v for k, v in labels.items()):
            return float(m.group(2))
    return None


@pytest.fixture(scope="module")
def workers(tiny_llama):
    """The module's workers, after their hand-offs: the tcp prefill worker's two (one whole pull, one refused
    for its expired lease), then one from the other prefill worker."""
    mp = pytest.MonkeyPatch()
    mp.delenv("UCX_TLS", raising=False)  # the decode worker and the second prefill worker get UCX's defaults
    model = f"pairs-{uuid.uuid4().hex[:8]}"
    common = ("--served-model-name", model, "--grammar-start", "lazy")  # no grammar processes: none is constrained
    pport, sport, dmet = free_port(), free_port(), free_port()
    procs = []
    try:
        procs.append(start_worker(tiny_llama, "prefill", *common, port=pport, env=TCP, redis_url=REDIS)[0])
        procs.append(start_worker(tiny_llama, "prefill", *common, port=sport, redis_url=REDIS)[0])
        decode, dport = start_worker(tiny_llama, "decode", *common, "--metrics-port", str(dmet), "--metrics-compat",
                                     "vllm", redis_url=REDIS)
        procs.append(decode)
        want, took = asyncio.run(_hand_offs(pport, sport, dport))
        yield dict(model=model, dport=dport, dmet=dmet, tcp_peer=f"prefill-{pport}", shm_peer=f"prefill-{sport}",
                   want=want, took=took)
    finally:
        for p in procs:
            stop_worker(p)
        mp.undo()


async def _hand_offs(pport: int, sport: int, dport: int) -> tuple[int, float]:
    await asyncio.gather(wait_serving(pport), wait_serving(sport), wait_serving(dport))
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
    pre = await ps.Prefill(worker_pb2.PrefillRequest(request_id="b", prompt_token_ids=prompt[::-1], params=PARAMS))
    pre.kv.lease_expiry_unix = time.time() - 1
    msgs = [m async for m in ds.GenerateFromPrefill(worker_pb2.GenerateFromPrefillRequest(
        request_id="b", prompt_token_ids=prompt[::-1], params=PARAMS, first_tokens=pre.first_tokens, kv=pre.kv))]
    assert msgs[-1].state == "FAILED" and msgs[-1].retryable, msgs[-1]
    # one hand-off from the prefill worker with UCX's defaults
    ss = worker_pb2_grpc.WorkerStub(channel(f"127.0.0.1:{sport}"))
    pre_s = await ss.Prefill(worker_pb2.PrefillRequest(request_id="c", prompt_token_ids=prompt, params=PARAMS))
    msgs = [m async for m in ds.GenerateFromPrefill(worker_pb2.GenerateFromPrefillRequest(
        request_id="c", prompt_token_ids=prompt, params=PARAMS, first_tokens=pre_s.first_tokens, kv=pre_s.kv))]
    assert msgs[-1].state == "FINISHED", msgs[-1]
    return want, t.kv_transfer_end - t.kv_transfer_start


def test_pull_bytes_travel_back_and_are_counted_per_peer(workers):
    dmet, peer, want, took = workers["dmet"], workers["tcp_peer"], workers["want"], workers["took"]
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
    assert _sample(text, "pdserve_kv_transport_info", backend="UCX", transport="auto", source="default") == 1
    # vLLM's names, from the same samples
    assert _sample(text, "vllm:nixl_bytes_transferred_sum", peer=peer) == want
    assert _sample(text, "vllm:nixl_xfer_time_seconds_count", peer=peer) == 1
    assert _sample(text, "vllm:nixl_num_failed_transfers_total", peer=peer, reason="lease_expired") == 1


def _observed(port: int) -> dict[str, str]:
    """peer -> observed, from the decode worker's pdserve_kv_pair_transport_info samples."""
    out = {}
    for m in re.finditer(r"^pdserve_kv_pair_transport_info\{([^}]*)\} 1\.0$", _scrape(port), re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        out[labels["peer"]] = labels["observed"]
    return out


def test_the_transport_ucx_chose_per_peer(workers):
    dmet, shm_peer, tcp_peer = workers["dmet"], workers["shm_peer"], workers["tcp_peer"]
    seen = _observed(dmet)  # read after each peer's first pull, before its answer streamed
    print("observed:", seen)
    assert set(seen) == {shm_peer, tcp_peer} and seen[shm_peer] in SHM and seen[tcp_peer] == "tcp", seen
    # `pdserve status` (the registry's records, at the decode worker's next heartbeat)
    model, dec = workers["model"], f"decode-{workers['dport']}"
    end = time.monotonic() + 10
    while True:
        st = asyncio.run(status.from_redis(REDIS, model, None, NO_AUTH))
        ws = {w["id"]: w for w in st["workers"]}
        if len(ws.get(dec, {}).get("kv_transport_observed", {})) == 2:
            break
        assert time.monotonic() < end, st
        time.sleep(0.2)
    assert ws[dec]["kv_transport"] == "UCX/auto (default)" and ws[dec]["kv_transport_observed"] == seen, ws[dec]
    assert ws[tcp_peer]["kv_transport"] == "UCX/tcp (configured)" and ws[tcp_peer]["kv_transport_observed"] == {}
    want = "KV over UCX/auto (default), used " + ", ".join(f"{t} from {p}" for p, t in sorted(seen.items()))
    assert want in status.format_text(st), status.format_text(st)


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
