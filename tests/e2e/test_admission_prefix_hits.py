"""Admission net of prefix-cache hits end to end (real `pdserve up`, colocated, one worker of 18 KV blocks of 4
tokens, no admission queue: what does not fit is 503 at once). The router's hit on the placed worker reaches the
gateway's reservation: 4 requests behind one cached 40-token prefix are admitted together; the same 4 with
distinct prefixes are not (docs/admission.md, "Prefix-cache hits")."""
from __future__ import annotations

import random
import threading

import httpx
import pytest

from tests.e2e.conftest import Up, served_as_ck, wait_until

N = 4
# a prompt: 40 shared tokens (10 blocks) + 2 of its own = 11 blocks; 4 output tokens: 1 block (46 tokens in all,
# 12 blocks). One uncached copy: 12 blocks; each request behind the cached prefix: 2 of its own. 12 + 3 x 2 = 18
BLOCKS = 12 + (N - 1) * 2


@pytest.fixture(scope="module")
def up(tiny_llama, tmp_path_factory):
    model, _ = served_as_ck(tiny_llama, tmp_path_factory, "tenants: {}\n")
    d = Up(model, "--mode", "colocated", "--workers", "1", "--num-gpu-blocks", str(BLOCKS), "--block-size", "4",
           "--admission-queue", "0")
    yield d
    assert d.stop() == 0


def _post(up, prompt: list[int]) -> httpx.Response:
    return httpx.post(up.base_url + "/v1/completions", headers={"x-pdserve-debug": "route"}, timeout=120,
                      json={"model": "ck", "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True})


def _together(up, prompts: list[list[int]]) -> list[int]:
    """The prompts sent at the same moment; their status codes."""
    go = threading.Barrier(len(prompts))
    codes = [0] * len(prompts)

    def one(i: int) -> None:
        go.wait()
        codes[i] = _post(up, prompts[i]).status_code

    ts = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return codes


def _route_hit(r: httpx.Response) -> int:
    route = dict(kv.split("=", 1) for kv in r.headers["x-pdserve-route"].split(";") if "=" in kv)
    return int(route.get("cached_tokens", 0))


def test_shared_prefix_admitted_together_distinct_not(up):
    rng = random.Random(7)
    prefix = [rng.randrange(3, 300) for _ in range(40)]
    warm = _post(up, prefix + [1, 2])
    assert warm.status_code == 200, warm.text
    # the router learns the worker's blocks from its KV events: wait until it places with the hit
    assert wait_until(lambda: _route_hit(_post(up, prefix + [1, 3])) >= 40, timeout=30)
    codes = _together(up, [prefix + [9, i] for i in range(N)])
    assert codes == [200] * N, codes  # 10 pinned blocks once + 4 x 2: 18, the whole budget
    # 12 blocks each: one at a time fits 18. On a loaded box the four can arrive one after another, each done
    # before the next (all 200, rightly): up to three rounds of fresh prompts for one where they overlapped
    rounds = []
    for _ in range(3):
        distinct = [[rng.randrange(3, 300) for _ in range(42)] for _ in range(N)]
        rounds.append(_together(up, distinct))
        if 503 in rounds[-1]:
            break
    assert 503 in rounds[-1] and all(200 in codes for codes in rounds), rounds
