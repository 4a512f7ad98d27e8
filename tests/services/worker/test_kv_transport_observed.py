"""The transport UCX really chose for a decode worker's KV READs from each prefill peer (kv_transfer/ucx_log.py),
per peer on `pdserve_kv_pair_transport_info` and in `pdserve status`, next to the configured one.

Real worker processes on one host, real NIXL READs, real Redis. One decode worker with UCX's defaults (UCX_TLS
unset: configured `auto`) pulls from two prefill workers:
- one with UCX's defaults too: between two processes of one host UCX reads through cross-memory attach, the bypass
  the lab found (the KV never crosses a network). Observed: a shared-memory kind.
- one with UCX_TLS=tcp (what `pdserve lab` sets): it offers UCX nothing but TCP, so the decode worker's READs from
  it go over TCP although its own configuration allows everything. Observed: `tcp`.
An observation that echoed the configuration says `auto` for both and fails; one that guessed from the host (one
host: shared memory) fails the second; one that did not tell the peers apart fails one of the two.
"""
import asyncio
import re
import time
import urllib.request
import uuid

from pdserve.engine.sampling_params import SamplingParams
from pdserve.services import status
from pdserve.services.convert import params_to_pb
from pdserve.services.grpc_util import channel
from pdserve.services.pb import worker_pb2, worker_pb2_grpc
from pdserve.services.ports import free_port
from pdserve.services.redis_conn import NO_AUTH
from tests.services._workers import start_worker, stop_worker, wait_serving

REDIS = "redis://127.0.0.1:6379/0"
PARAMS = params_to_pb(SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
SHM = {"cma", "posix", "sysv", "xpmem", "knem"}  # UCX's transports within one host (shared memory, CMA)


def _observed(port: int) -> dict[str, str]:
    """peer -> observed, from the decode worker's pdserve_kv_pair_transport_info samples."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for m in re.finditer(r'^pdserve_kv_pair_transport_info\{([^}]*)\} 1\.0$', text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        out[labels["peer"]] = labels["observed"]
    return out


async def _pull(pport: int, dport: int, rid: str) -> None:
    """One hand-off: a prefill on the prefill worker, its KV pulled by the decode worker (a real NIXL READ)."""
    ps = worker_pb2_grpc.WorkerStub(channel(f"127.0.0.1:{pport}"))
    ds = worker_pb2_grpc.WorkerStub(channel(f"127.0.0.1:{dport}"))
    prompt = list(range(3, 60))
    pre = await ps.Prefill(worker_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt, params=PARAMS))
    msgs = [m async for m in ds.GenerateFromPrefill(worker_pb2.GenerateFromPrefillRequest(
        request_id=rid, prompt_token_ids=prompt, params=PARAMS, first_tokens=pre.first_tokens, kv=pre.kv))]
    assert msgs[-1].state == "FINISHED", msgs[-1]


def test_the_transport_ucx_chose_per_peer(tiny_llama, monkeypatch):
    monkeypatch.delenv("UCX_TLS", raising=False)
    model = f"xport-{uuid.uuid4().hex[:8]}"
    common = ("--served-model-name", model)
    procs = []
    try:
        p, shm_port = start_worker(tiny_llama, "prefill", *common, redis_url=REDIS)
        procs.append(p)
        p, tcp_port = start_worker(tiny_llama, "prefill", *common, redis_url=REDIS, env={"UCX_TLS": "tcp"})
        procs.append(p)
        met = free_port()
        p, dport = start_worker(tiny_llama, "decode", *common, "--metrics-port", str(met), redis_url=REDIS)
        procs.append(p)
        shm_peer, tcp_peer = f"prefill-{shm_port}", f"prefill-{tcp_port}"

        async def main():
            await asyncio.gather(*(wait_serving(port) for port in (shm_port, tcp_port, dport)))
            await _pull(shm_port, dport, "r-shm")
            await _pull(tcp_port, dport, "r-tcp")

        asyncio.run(main())
        end = time.monotonic() + 15  # observed after each pair's self-test, in the background
        while len(seen := _observed(met)) < 2:
            assert time.monotonic() < end, f"no observation within 15 s of the first pulls: {seen}"
            time.sleep(0.2)
        print("observed:", seen)
        assert seen[shm_peer] in SHM and seen[tcp_peer] == "tcp", seen

        # `pdserve status` (the registry's records, at the decode worker's next heartbeat)
        end = time.monotonic() + 10
        while len((ws := {w["id"]: w for w in asyncio.run(status.from_redis(REDIS, model, None, NO_AUTH))["workers"]})
                  .get(f"decode-{dport}", {}).get("kv_transport_observed", {})) < 2:
            assert time.monotonic() < end, ws
            time.sleep(0.2)
        d = ws[f"decode-{dport}"]
        assert d["kv_transport"] == "UCX/auto (default)" and d["kv_transport_observed"] == seen, d
        assert ws[tcp_peer]["kv_transport"] == "UCX/tcp (configured)" and ws[tcp_peer]["kv_transport_observed"] == {}
        text = status.format_text(asyncio.run(status.from_redis(REDIS, model, None, NO_AUTH)))
        want = "KV over UCX/auto (default), used " + ", ".join(f"{t} from {p}" for p, t in sorted(seen.items()))
        assert want in text, text
    finally:
        for p in procs:
            stop_worker(p)
