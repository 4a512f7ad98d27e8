"""Decode-side prefix reuse: which blocks a disaggregated request pulls (pull_plan.py), and a real hand-off between
two engines in this process (the NIXL READ replaced by copying exactly the planned blocks) whose tokens must equal
the offline engine's on the same prompt: with the next turn's prefix cached on the decode side, with it evicted
between the router's decision and the pull, and with reuse off."""
import pytest

from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.outputs import FirstToken
from pdserve.engine.sampling_params import SamplingParams
from pdserve.services.decode.pull_plan import pull_plan

BS = 4
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_pull_plan_is_the_uncached_tail():
    src, dst = [40, 41, 42, 43, 44], [7, 8, 9, 10, 11, 12]  # dst may hold more blocks than the prompt fills
    # 17 tokens at 4 per block fill 5 blocks; 3 cached -> blocks 3 and 4 move, pairwise
    p = pull_plan(src, dst, 3, 17, BS)
    assert (p.src, p.dst, p.reused) == ([43, 44], [10, 11], 3)
    assert pull_plan(src, dst, 0, 17, BS).src == src  # nothing cached: everything
    assert pull_plan(src, dst, 0, 16, BS).src == src[:4]  # exactly 4 full blocks: the 5th id is not read
    for bad in ((6, 17), (-1, 17), (0, 21)):  # more cached than the prompt fills; a handle too short
        with pytest.raises(ValueError):
            pull_plan(src, dst, *bad, BS)


def _handoff(pre: Engine, dec: Engine, rid: str, prompt: list[int]) -> tuple[list[int], int, int]:
    """Prefill on `pre`, pull on `dec` only the planned blocks, decode there. (tokens, reused, pulled)."""
    pre.add_request(rid, prompt, GREEDY, prefill_only=True)
    done = []
    while pre.has_unfinished():
        done += [o for o in pre.step() if o.finished]
    first = done[0].outputs[0]
    src, ntok = pre.pinned_kv(rid)
    dst, cached = dec.add_prefilled_request(rid, prompt, [FirstToken(first.token_ids[0], first.cumulative_logprob)],
                                            GREEDY)
    plan = pull_plan(src, dst, cached, ntok, BS)
    dec.kv_cache.data[plan.dst] = pre.kv_cache.data[plan.src]
    pre.release_pinned(rid)
    assert dec.commit_prefilled(rid)
    final = None
    while dec.has_unfinished():
        final = next((o for o in dec.step() if o.finished), final)
    return list(final.outputs[0].token_ids), plan.reused, len(plan.src)


@pytest.mark.parametrize("case", ["reuse", "evicted", "off"])
def test_next_turn_pulls_the_missing_blocks_and_matches_offline(tiny_llama, case):
    cfg = dict(block_size=BS, dtype="float32")
    pre = Engine.from_pretrained(tiny_llama, EngineConfig(num_gpu_blocks=64, **cfg))
    dec = Engine.from_pretrained(tiny_llama, EngineConfig(num_gpu_blocks=16, no_decode_prefix_reuse=case == "off",
                                                          **cfg))
    turn1 = [(13 * i) % 250 + 3 for i in range(22)]
    answer, reused, pulled = _handoff(pre, dec, "t1", turn1)
    assert (reused, pulled) == (0, 6)  # 22 tokens: 6 blocks, none cached yet
    turn2 = turn1 + answer + [(7 * i) % 250 + 3 for i in range(9)]  # 37 tokens: 10 blocks
    if case == "evicted":  # the decode worker evicts the prefix after the router's lookup: it pulls everything
        for k in range(3):
            dec.generate([[(k * 31 + 5 * i) % 250 + 3 for i in range(40)]], GREEDY)
    got, reused, pulled = _handoff(pre, dec, "t2", turn2)
    # the decode side holds turn 1 and its answer but the last token (never fed back): 27 tokens, 6 full blocks
    want_reused = {"reuse": 6, "evicted": 0, "off": 0}[case]
    assert (reused, pulled) == (want_reused, 10 - want_reused)
    ref = Engine.from_pretrained(tiny_llama, EngineConfig(num_gpu_blocks=64, **cfg))
    assert got == list(ref.generate([turn2], GREEDY)[0].outputs[0].token_ids)


def test_pull_plan_skips_released_blocks():
    """Every layer windowed: both sides released the leading blocks (-1); only held ones move. A prefill-side hole
    where this side holds a block means the two disagree on the window: refused."""
    p = pull_plan([-1, -1, 42, 43, 44], [-1, -1, 9, 10, 11], 0, 17, BS)
    assert (p.src, p.dst, p.reused) == ([42, 43, 44], [9, 10, 11], 0)
    with pytest.raises(ValueError, match="released a block"):
        pull_plan([-1, -1, 42, 43, 44], [-1, 8, 9, 10, 11], 0, 17, BS)


def test_windowed_model_hands_off_only_the_window(tmp_path):
    """Mistral with an 8-token window, blocks of 4, a 41-token prompt: the first decode (position 41) reads keys
    34..41, so of the prompt's 11 blocks the (41 - 8 + 1) // 4 = 8 before the window are released by the prefill
    side, never allocated by the decode side and not pulled: 3 blocks pinned, allocated and pulled (by hand). The
    decoded tokens equal transformers'."""
    import torch
    import transformers as tf

    from tests.conftest import make_checkpoint
    ckpt = make_checkpoint(tmp_path, arch="mistral", sliding_window=8)
    cfg = dict(block_size=BS, dtype="float32")
    pre = Engine.from_pretrained(ckpt, EngineConfig(num_gpu_blocks=32, **cfg))
    dec = Engine.from_pretrained(ckpt, EngineConfig(num_gpu_blocks=12, **cfg))
    prompt = [(11 * i) % 250 + 3 for i in range(41)]
    pre.add_request("w", prompt, GREEDY, prefill_only=True)
    first = None
    while pre.has_unfinished():
        first = next((o for o in pre.step() if o.finished), first)
    src, ntok = pre.pinned_kv("w")
    assert pre.core.num_pinned_blocks() == 3 == pre.block_manager.blocks_in_use
    ft = first.outputs[0]
    dst, cached = dec.add_prefilled_request("w", prompt, [FirstToken(ft.token_ids[0], ft.cumulative_logprob)],
                                            GREEDY)
    assert dec.block_manager.blocks_in_use == 3 and dst[:8] == [-1] * 8
    plan = pull_plan(src, dst, cached, ntok, BS)
    assert len(plan.src) == 3 and plan.reused == 0
    dec.kv_cache.data[plan.dst] = pre.kv_cache.data[plan.src]
    pre.release_pinned("w")
    assert dec.commit_prefilled("w")
    final = None
    while dec.has_unfinished():
        final = next((o for o in dec.step() if o.finished), final)
    assert pre.block_manager.blocks_in_use == 0 == dec.block_manager.blocks_in_use
    hf = tf.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                       pad_token_id=0)[0, len(prompt):].tolist()
    assert list(final.outputs[0].token_ids) == want
