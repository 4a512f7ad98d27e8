"""Tenant KV shares end to end (real `pdserve up`, keys file, HTTP): the quiet tenant's `kv_share` travels from
the keys file through admission and the worker request to the engine's eviction, so its cached prefix survives a
noisy tenant's churn while an unprotected tenant's does not (docs/admission.md "Tenant KV shares",
docs/engine.md "Tenant-fair eviction")."""
from __future__ import annotations

import concurrent.futures as cf
import os
import random

import httpx
import pytest

from tests.e2e.conftest import Up, served_as_ck

KEYS = """
tenants:
  quiet: {keys: [sk-quiet], kv_share: 0.35, permissions: [debug_route]}
  other: {keys: [sk-other]}
  noisy: {keys: [sk-noisy]}
"""


@pytest.fixture(scope="module")
def up(tiny_llama, tmp_path_factory):
    model, keys = served_as_ck(tiny_llama, tmp_path_factory, KEYS)
    # 24 KV blocks of 4 tokens: floor(0.35 x 24) = 8 blocks guaranteed to the quiet tenant
    # the worker's labels (PDSERVE_LABELS = `pdserve worker --labels`) reach the router through the registry
    os.environ["PDSERVE_LABELS"] = "zone=z1,node=n1"
    try:
        d = Up(model, "--mode", "colocated", "--workers", "1", "--api-keys-file", str(keys), "--num-gpu-blocks",
               "24", "--block-size", "4")
    finally:
        del os.environ["PDSERVE_LABELS"]
    yield d
    assert d.stop() == 0


def _complete(up, key: str, prompt: list[int]) -> dict:
    r = httpx.post(up.base_url + "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                   json={"model": "ck", "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True},
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _cached(body: dict) -> int:
    return (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def test_quiet_tenant_prefix_survives_noisy_churn(up):
    rng = random.Random(0)
    quiet = [rng.randrange(3, 300) for _ in range(33)]  # 8 full blocks of 4 + the last token
    other = [rng.randrange(3, 300) for _ in range(33)]
    first = _complete(up, "sk-quiet", quiet)
    assert _cached(first) == 0
    assert _cached(_complete(up, "sk-other", other)) == 0
    with cf.ThreadPoolExecutor(3) as ex:  # the noisy tenant: rounds of 3 distinct 26-token prompts
        for _ in range(4):
            list(ex.map(lambda p: _complete(up, "sk-noisy", p),
                        [[rng.randrange(3, 300) for _ in range(26)] for _ in range(3)]))
    again = _complete(up, "sk-quiet", quiet)
    assert _cached(again) == 32 and again["choices"][0]["text"] == first["choices"][0]["text"]
    assert _cached(_complete(up, "sk-other", other)) == 0  # the unprotected tenant's prefix was churned out


def test_route_header_shows_the_zone_and_terms(up):
    r = httpx.post(up.base_url + "/v1/completions", headers={"Authorization": "Bearer sk-quiet",
                                                             "x-pdserve-debug": "route"},
                   json={"model": "ck", "prompt": [5, 6, 7, 8, 9], "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
    route = dict(kv.split("=", 1) for kv in r.headers["x-pdserve-route"].split(";"))
    assert route["zone"] == "z1"
    assert {"fd_s", "price_s", "fair_s"} <= set(route) and float(route["fd_s"]) == 0.0  # one worker: no spread
