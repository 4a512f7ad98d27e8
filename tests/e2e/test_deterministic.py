"""`pdserve up --deterministic`, colocated and disaggregated: N concurrent greedy requests sharing a cached prefix,
their prompts chunked (a small step budget), get exactly the token ids and logprobs each gets served alone, and
exactly the offline deterministic engine's, each prompt alone, uncached, in one step (the reference; JSON floats
round-trip exactly). The engine-level tests (tests/engine/test_batch_invariant.py) cover seeded sampling and
migration."""
from __future__ import annotations

import concurrent.futures as cf

import httpx
import pytest

from tests.e2e.conftest import NUM_BLOCKS, Up, metric, wait_until

PREFIX = "seven wizards quietly hex every jolly sphinx of black quartz; "
PROMPTS = [PREFIX + s for s in ("the quick brown fox", "judge my vow", "pack my box", "five dozen jugs")]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def reference(tiny_llama):
    from pdserve.engine.engine import Engine, EngineConfig
    from pdserve.engine.sampling_params import SamplingParams
    eng = Engine.from_pretrained(str(tiny_llama), EngineConfig(num_gpu_blocks=NUM_BLOCKS, deterministic=True,
                                                               enable_prefix_caching=False))
    p = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    return [(list(o.outputs[0].token_ids), [r.logprob for r in o.outputs[0].logprobs])
            for o in (eng.generate([x], p)[0] for x in PROMPTS)]


def complete(up, prompt) -> tuple[list[int], list[float]]:
    r = httpx.post(up.base_url + "/v1/completions", timeout=60, json={
        "model": "ck", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "logprobs": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    return list(c["token_ids"]), list(c["logprobs"]["token_logprobs"])


def check(up, reference):
    alone = [complete(up, p) for p in PROMPTS]  # the first leaves the prefix cached for the rest
    with cf.ThreadPoolExecutor(len(PROMPTS)) as ex:  # concurrently: they batch on the workers
        together = list(ex.map(lambda p: complete(up, p), PROMPTS))
    assert alone == reference
    assert together == reference
    # the prefix really was served from the cache (on the worker that prefills; its counters follow the engine's
    # published stats, a moment behind)
    role = "both" if up.info["mode"] == "colocated" else "prefill"

    def hits() -> float:
        return sum(metric(w["metrics_port"], "pdserve_prefix_cache_hits_total") for w in up.workers(role))
    assert wait_until(lambda: hits() >= len(PREFIX) // 2, 10), hits()


@pytest.mark.parametrize("mode", ["colocated", "disagg"])
def test_concurrent_greedy_equals_alone_bit_for_bit(tiny_llama, reference, mode):
    import shutil
    model = tiny_llama.parent / "ck"
    if not model.exists():
        shutil.copytree(tiny_llama, model)
    workers = ["--workers", "1"] if mode == "colocated" else ["--prefill", "1", "--decode", "1"]
    d = Up(model, "--mode", mode, *workers, "--deterministic", "--max-num-batched-tokens", "16")
    try:
        check(d, reference)
    finally:
        d.stop()
