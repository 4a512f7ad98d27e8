"""The gateway's gRPC front door goes through the HTTP API's request path (real `pdserve up`, API keys on):
no key or a wrong one is refused, the tenant's rate limit applies, each call leaves one billing record, and the
prefix-cache namespace is the tenant's whatever the request says."""
from __future__ import annotations

import asyncio
import re
import urllib.request

import grpc
import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.services.grpc_util import channel
from pdserve.services.convert import params_to_pb
from pdserve.services.pb import gateway_pb2_grpc, worker_pb2
from tests.e2e.conftest import Up, served_as_ck

KEYS = """
tenants:
  alice: {keys: [sk-alice], permissions: [metrics]}
  bob: {keys: [sk-bob]}
  slow: {keys: [sk-slow], rate_rps: 0.01, burst: 1}
"""
PROMPT = list(range(30, 100))  # 70 tokens: 4 full blocks


@pytest.fixture(scope="module")
def up(tiny_llama, tmp_path_factory):
    model, keys = served_as_ck(tiny_llama, tmp_path_factory, KEYS)
    d = Up(model, "--mode", "colocated", "--workers", "1", "--api-keys-file", str(keys))
    yield d
    assert d.stop() == 0


def _generate(up, key: str | None, namespace: str = "", timeout: float | None = 30, max_tokens: int = 4):
    async def main():
        stub = gateway_pb2_grpc.GatewayStub(channel(f"127.0.0.1:{up.process('gateway')['grpc_port']}"))
        md = (("authorization", f"Bearer {key}"),) if key else ()
        msgs = []
        async for m in stub.Generate(worker_pb2.GenerateRequest(
                prompt_token_ids=PROMPT, namespace=namespace,
                params=params_to_pb(SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))),
                metadata=md, timeout=timeout):
            msgs.append(m)
        return msgs
    return asyncio.run(main())


def _records(up, tenant: str) -> float:
    req = urllib.request.Request(up.base_url + "/metrics", headers={"Authorization": "Bearer sk-alice"})
    with urllib.request.urlopen(req, timeout=5) as r:
        text = r.read().decode()
    return sum(float(m.group(1)) for m in re.finditer(
        rf'^pdserve_usage_records_total\{{[^}}]*tenant="{tenant}"[^}}]*\}}\s+(\S+)$', text, re.M))


@pytest.mark.parametrize("key", [None, "sk-wrong"])
def test_refused_without_a_valid_key(up, key):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        _generate(up, key)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "API key" in e.value.details()


def test_served_and_billed_once(up):
    before = _records(up, "alice")
    msgs = _generate(up, "sk-alice")
    assert msgs[-1].finished and msgs[-1].state == "FINISHED"
    assert sum(len(o.token_ids) for m in msgs for o in m.outputs) == 4
    assert _records(up, "alice") == before + 1


def test_rate_limit_applies(up):
    _generate(up, "sk-slow")  # the bucket's one token
    with pytest.raises(grpc.aio.AioRpcError) as e:
        _generate(up, "sk-slow")
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "rate_limit_exceeded" in e.value.details()


def test_namespace_is_the_tenants(up):
    """bob names alice's namespace in the request: he still gets no hit on alice's cached prompt."""
    _generate(up, "sk-alice", namespace="alice")
    assert _generate(up, "sk-alice")[-1].usage.cached_tokens > 0  # alice hits her own prefix
    assert _generate(up, "sk-bob", namespace="alice")[-1].usage.cached_tokens == 0
