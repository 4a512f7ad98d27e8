"""`pdserve up --mode disagg` with `--prefill-tp 2 --decode-tp 1` and `--prefill-tp 1 --decode-tp 2`: the
TP=2 side runs two ranks, each holding one of the tiny Llama's two KV heads; a decode rank pulls the head slices it
owns from the prefill rank(s) holding them (kv_transfer/tp_pull.py). Greedy output equals the offline engine's, and a
dropped stream leaves no blocks in use. 2 -> 2 and a replicated head are covered worker to worker in
tests/services/worker/test_disagg_tp.py."""
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


@pytest.fixture(scope="module", params=[(2, 1), (1, 2)], ids=["prefill-tp2-decode-tp1", "prefill-tp1-decode-tp2"])
def up(tiny_llama, request):
    ptp, dtp = request.param
    import shutil
    model = tiny_llama.parent / "ck"  # the served model name the shared checks ask for
    if not model.exists():
        shutil.copytree(tiny_llama, model)
    d = Up(model, "--mode", "disagg", "--prefill", "1", "--decode", "1", "--prefill-tp", str(ptp),
           "--decode-tp", str(dtp), "--dtype", "float32", timeout=180)
    yield d
    d.stop()


def test_greedy_matches_offline_engine_across_tp_degrees(up, offline_fp32):
    _common.check_greedy_batch(up, offline_fp32)
    pulled = sum(metric(w["metrics_port"], "pdserve_kv_transfer_bytes_total") for w in up.workers("decode"))
    assert pulled > 0


def test_disconnect_frees_blocks(up):
    _common.check_disconnect_frees_blocks(up)
