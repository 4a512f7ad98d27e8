"""`pdserve up --mode disagg --kv-cache-dtype fp8_e4m3`: both pools store K/V as one byte per value, the decode
worker pulls the quantized blocks over NIXL, and greedy output equals the offline engine's with the same KV dtype
(the prompt's own attention in fp32, every later read through the fp8 pool, on both sides alike)."""
import pytest

from tests.e2e import _common
from tests.e2e.conftest import NUM_BLOCKS, PROMPTS, Up, metric


@pytest.fixture(scope="module")
def offline_fp8(tiny_llama):
    from pdserve.engine.engine import Engine, EngineConfig
    from pdserve.engine.sampling_params import SamplingParams
    eng = Engine.from_pretrained(str(tiny_llama), EngineConfig(num_gpu_blocks=NUM_BLOCKS, dtype="float32",
                                                               kv_cache_dtype="fp8_e4m3"))
    outs = eng.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12))
    assert eng.kv_cache.block_bytes == 2 * 2 * eng.config.block_size * 2 * 16  # one byte per value
    return [(o.outputs[0].token_ids, o.outputs[0].text) for o in outs], eng.kv_cache.block_bytes


@pytest.fixture(scope="module")
def up(tiny_llama):
    import shutil
    model = tiny_llama.parent / "ck"  # the served model name the shared checks ask for
    if not model.exists():
        shutil.copytree(tiny_llama, model)
    d = Up(model, "--mode", "disagg", "--prefill", "1", "--decode", "1", "--dtype", "float32",
           "--kv-cache-dtype", "fp8_e4m3", timeout=120)
    yield d
    d.stop()


def test_greedy_over_fp8_kv_matches_offline_engine(up, offline_fp8):
    greedy, fp8_block_bytes = offline_fp8
    _common.check_greedy_batch(up, greedy)
    pulled = sum(metric(w["metrics_port"], "pdserve_kv_transfer_bytes_total") for w in up.workers("decode"))
    # whole fp8 blocks moved: a quarter of the fp32 pool's block (the tiny Llama: 2 layers x 2 x 2 heads x 16)
    assert pulled > 0 and pulled % fp8_block_bytes == 0, (pulled, fp8_block_bytes)
