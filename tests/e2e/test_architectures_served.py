"""The architectures beyond the Llama family, each served by `pdserve up --mode disagg` (1 prefill + 1 decode
worker, the KV handed over NIXL) from a tiny random checkpoint saved by transformers: greedy tokens through the
official `openai` client equal transformers' `generate` on the same weights. One deployment per architecture,
a few prompts of a few tokens each (the engine-level checks of each are in tests/engine/)."""
from __future__ import annotations

import json

import openai
import pytest
import torch
import transformers as tf

from tests.conftest import make_checkpoint
from tests.e2e.conftest import Up, metric

# Prompts as token ids: the comparison does not depend on how the gateway tokenizes text. Longer than the
# checkpoints' sliding windows (6 tokens), so the windowed layers drop keys on both sides of the hand-off.
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [40, 41, 42], list(range(60, 75))]
MAX_TOKENS = 8
BLOCK_SIZE = 16  # pdserve up's default --block-size
ARCHS = {"gpt-oss": dict(arch="gpt_oss"), "deepseek-v3": dict(arch="deepseek_v3"), "phi3": dict(arch="phi3"),
         # pools at different degrees: the prefill worker 2 ranks with the 8 experts split 4 + 4 and the latent
         # replicated on both, the decode worker 1 rank pulling the latent once
         "deepseek-v3-prefill-ep2": dict(arch="deepseek_v3"),
         # expert parallelism without tensor parallelism: the decode worker 2 ranks, each with every head and its
         # own whole copy of the KV (pulled per rank), the 4 experts split 2 + 2 and reached by all-to-all
         "gpt-oss-decode-ep2": dict(arch="gpt_oss")}
FLAGS = {"deepseek-v3-prefill-ep2": ("--prefill-tp", "2", "--prefill-ep", "2"), "gpt-oss-decode-ep2": ("--decode-ep", "2")}


@pytest.fixture(scope="module", params=list(ARCHS))
def served(request, tmp_path_factory):
    model = make_checkpoint(tmp_path_factory.mktemp(request.param) / "ck", **ARCHS[request.param])
    d = Up(model, "--mode", "disagg", "--prefill", "1", "--decode", "1", *FLAGS.get(request.param, ()))
    d.model_dir = model
    yield d
    d.stop()


def test_greedy_through_disagg_equals_transformers(served):
    hf = tf.AutoModelForCausalLM.from_pretrained(served.model_dir, dtype=torch.float32).eval()
    client = openai.OpenAI(base_url=served.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    name = client.models.list().data[0].id
    for prompt in PROMPTS:
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
        raw = client.completions.with_raw_response.create(
            model=name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True}, extra_headers={"x-pdserve-debug": "route"})
        route = dict(kv.split("=", 1) for kv in raw.headers["x-pdserve-route"].split(";"))
        assert route["mode"] == "disagg", route  # prefilled on one worker, decoded on the other
        r = raw.parse()
        assert r.choices[0].model_extra["token_ids"] == ref, (prompt, r.choices[0])
        assert r.usage.completion_tokens == MAX_TOKENS
    # what the decode worker pulled is whole blocks of the pool's layout: for DeepSeek, latents (kv_lora_rank +
    # qk_rope_head_dim per token and layer), not per-head K/V (one copy, from one of the prefill ranks holding it)
    cfg = json.loads((served.model_dir / "config.json").read_text())
    if "kv_lora_rank" in cfg:
        per_token = cfg["num_hidden_layers"] * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 4  # fp32 pool
        blocks = sum(-(-len(p) // BLOCK_SIZE) for p in PROMPTS)
        moved = metric(served.workers("decode")[0]["metrics_port"], "pdserve_kv_transfer_bytes_total")
        assert moved == blocks * BLOCK_SIZE * per_token, (moved, blocks, per_token)  # the decode pool: 1 rank
