"""Speculative decoding through real processes: `pdserve up --mode disagg --speculative ngram`, the decode worker
verifying candidates after the prompt's KV came over NIXL. Greedy and seeded sampled outputs equal the offline
engine's plain decoding (n-gram proposals are a point mass: one uniform per committed token, as plain sampling),
and the decode worker's spec metrics count the verification work."""
import shutil

import httpx
import pytest

from tests.e2e import _common
from tests.e2e.conftest import Up, metric, wait_until


@pytest.fixture(scope="module")
def up(tiny_llama):
    model = tiny_llama.parent / "ck"
    if not model.exists():
        shutil.copytree(tiny_llama, model)
    d = Up(model, "--mode", "disagg", "--prefill", "1", "--decode", "1", "--speculative", "ngram",
           "--num-speculative-tokens", "3")
    yield d
    d.stop()


def test_disagg_decode_speculates_with_plain_outputs(up, offline_greedy, offline_seeded):
    _common.check_greedy_batch(up, offline_greedy)
    assert _common.seeded_ids(up) == offline_seeded
    # a prompt the model continues by repetition: lookups hit, candidates are verified and accepted
    r = httpx.post(up.base_url + "/v1/completions", json={"model": "ck", "prompt": "fox fox fox fox fox fox fox",
                                                          "max_tokens": 24, "temperature": 0}, timeout=30)
    assert r.status_code == 200, r.text
    dec = up.workers("decode")[0]["metrics_port"]
    assert wait_until(lambda: metric(dec, "pdserve_spec_proposed_tokens_total") > 0, 10)
    assert wait_until(lambda: metric(dec, "pdserve_spec_verify_steps_total") > 0, 10)
    acc = metric(dec, "pdserve_spec_accepted_tokens_total")
    assert acc <= metric(dec, "pdserve_spec_proposed_tokens_total")
    assert 0.0 <= metric(dec, "pdserve_spec_acceptance_rate") <= 1.0
    assert metric(dec, "pdserve_spec_mean_accepted_length") >= 1.0
    _common.check_disconnect_frees_blocks(up)
