"""`pdserve up --mode disagg --prefill-tp 2 --decode-tp 1` (issue 17): the prefill worker runs two ranks, each
holding one of the tiny Llama's two KV heads; the decode worker pulls one head from each rank's pool
(kv_transfer/tp_pull.py). Greedy output equals the offline engine's, and a dropped stream leaves no blocks in use.
Other degree pairs (1 -> 2, 2 -> 2, a replicated head) are covered worker to worker in
tests/services/test_disagg_tp.py."""
import pytest

from tests.e2e import _common
from tests.e2e.conftest import NUM_BLOCKS, PROMPTS, Up, metric


@pytest.fixture(scope="module")
def offline_fp32(tiny_llama):
    """The offline engine's greedy (token ids, text) in float32, one process (what `up` runs with --dtype)."""
    from pdserve.engine.engine import Engine, EngineConfig
    from pdserve.engine.sampling_params import SamplingParams
    eng = Engine.from_pretrained(str(tiny_llama), EngineConfig(num_gpu_blocks=NUM_BLOCKS, dtype="float32"))
    outs = eng.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12))
    return [(o.outputs[0].token_ids, o.outputs[0].text) for o in outs]


@pytest.fixture(scope="module")
def up(tiny_llama):
    import shutil
    model = tiny_llama.parent / "ck"  # the served model name the shared checks ask for
    if not model.exists():
        shutil.copytree(tiny_llama, model)
    d = Up(model, "--mode", "disagg", "--prefill", "1", "--decode", "1", "--prefill-tp", "2",
           "--decode-tp", "1", "--dtype", "float32", timeout=180)
    yield d
    d.stop()


def test_greedy_matches_offline_engine_across_tp_degrees(up, offline_fp32):
    _common.check_greedy_batch(up, offline_fp32)
    pulled = sum(metric(w["metrics_port"], "pdserve_kv_transfer_bytes_total") for w in up.workers("decode"))
    assert pulled > 0


def test_disconnect_frees_blocks(up):
    _common.check_disconnect_frees_blocks(up)
