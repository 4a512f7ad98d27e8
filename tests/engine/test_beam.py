"""Beam search (spec §3.1) against `transformers` `generate(num_beams=B, do_sample=False)` on a tiny random Llama:
the same B hypotheses, in the same order, with the same scores, for several widths, length penalties and each
early_stopping mode; beams share KV by refcount and every block returns when the search ends."""
from __future__ import annotations

import pytest
import torch

from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.sampling_params import InvalidParameter, SamplingParams

MAX_NEW = 12
# Extra end tokens the random model does emit (the checkpoint's EOS, id 1, it hardly ever picks), so hypotheses end
# at different lengths and length penalty / early stopping matter. With this prompt and these three, the three
# early_stopping modes give different hypotheses (test_grid_exercises_eos_and_early_stopping).
P, ENDS = [9, 10, 11, 12, 13], [149, 177, 106]
CASES = [(w, lp, es, P, ENDS) for w in (2, 3, 4) for lp in (1.0, 2.0) for es in (True, False, "never")] + [
    (2, 0.0, False, [5, 6, 7], [149]), (3, -0.5, True, [5, 6, 7], [33, 47]), (4, 0.0, "never", [40, 41], [33, 47]),
    (4, -0.5, False, [5, 6, 7], [149]), (3, 0.0, "never", P, ENDS), (2, -0.5, True, P, ENDS)]


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return Engine.from_pretrained(tiny_llama, EngineConfig(dtype="float32", block_size=4, num_gpu_blocks=512))


@pytest.fixture(scope="module")
def hf(tiny_llama):
    import transformers as tf
    return tf.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def hf_beams(hf, prompt, width, lp, es, extra):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width, num_return_sequences=width,
                          do_sample=False, length_penalty=lp, early_stopping=es, max_new_tokens=MAX_NEW,
                          eos_token_id=[1] + extra, pad_token_id=1, output_scores=True, return_dict_in_generate=True)
    hyps = []
    for i in range(width):
        n = int((out.beam_indices[i] >= 0).sum())  # generated length of hypothesis i (the rest is padding)
        hyps.append((out.sequences[i, len(prompt):len(prompt) + n].tolist(), float(out.sequences_scores[i])))
    return hyps


def ours(engine, prompt, width, lp, es, extra):
    params = SamplingParams(max_tokens=MAX_NEW, beam_width=width, n=width, length_penalty=lp, early_stopping=es,
                            stop_token_ids=extra)
    out = engine.generate([prompt], params)[0]
    assert out.finished and out.state == "FINISHED"
    return [(c.token_ids, c.cumulative_logprob / len(c.token_ids) ** lp) for c in out.outputs]


@pytest.mark.parametrize("width,lp,es,prompt,ends", CASES)
def test_same_hypotheses_as_transformers(engine, hf, width, lp, es, prompt, ends):
    ref = hf_beams(hf, prompt, width, lp, es, ends)
    got = ours(engine, prompt, width, lp, es, ends)
    assert [t for t, _ in got] == [t for t, _ in ref]
    assert [s for _, s in got] == pytest.approx([s for _, s in ref], abs=2e-4)
    assert engine.block_manager.blocks_in_use == 0


def test_grid_exercises_eos_and_early_stopping(hf):
    """The grid above would not test EOS handling if no hypothesis ended on an end token, nor tell the
    early_stopping modes apart if they always agreed: here they do end, and do differ."""
    outs = {es: hf_beams(hf, P, 3, 2.0, es, ENDS) for es in (True, False, "never")}
    assert any(len(t) < MAX_NEW for t, _ in outs[True])
    assert outs[True] != outs[False] and outs[True] != outs["never"]


def test_beams_share_blocks_copy_on_write(tiny_llama):
    eng = Engine.from_pretrained(tiny_llama, EngineConfig(dtype="float32", block_size=4, num_gpu_blocks=256,
                                                          enable_prefix_caching=False))
    prompt = list(range(10, 22))  # 12 tokens: 3 full blocks every beam keeps sharing
    eng.add_request("b", prompt, SamplingParams(max_tokens=8, beam_width=4, ignore_eos=True))
    shared_seen = False
    while eng.has_unfinished():
        eng.step()
        req = eng.requests.get("b")
        if req is None or len(req.seqs) < 4:
            continue
        bm = eng.block_manager
        tables = [s.block_table for s in req.seqs]
        assert all(t[:3] == tables[0][:3] for t in tables)  # the prompt's blocks, held once
        assert all(bm.ref[b] == len(tables) for b in tables[0][:3])
        distinct = {b for t in tables for b in t}
        assert bm.blocks_in_use == len(distinct) < sum(len(t) for t in tables)
        shared_seen = True
    assert shared_seen
    assert eng.block_manager.blocks_in_use == 0 and all(r == 0 for r in eng.block_manager.ref)
    rec = eng.usage_records[-1]
    assert rec.state == "FINISHED" and rec.committed_tokens == 8 and rec.generated_tokens >= 8 * 4


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_beams_same_result(tiny_llama, mode):
    """A pool too small for three 4-beam searches at once: beams are preempted (recompute / swap), the others
    wait for them, and the hypotheses equal those of an unpressured engine."""
    small = Engine.from_pretrained(tiny_llama, EngineConfig(
        dtype="float32", block_size=2, num_gpu_blocks=24, max_num_seqs=4, preemption_mode=mode,
        num_cpu_blocks=64 if mode == "swap" else 0))
    big = Engine.from_pretrained(tiny_llama, EngineConfig(dtype="float32", block_size=2, num_gpu_blocks=512))
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [40, 41]]
    params = SamplingParams(max_tokens=MAX_NEW, beam_width=4, n=4, stop_token_ids=[149])
    got = [[c.token_ids for c in o.outputs] for o in small.generate(prompts, params)]
    ref = [[c.token_ids for c in o.outputs] for o in big.generate(prompts, params)]
    assert small.scheduler.num_preemptions[mode] > 0
    assert got == ref
    assert small.block_manager.blocks_in_use == 0 and small.block_manager.num_cpu_blocks == len(small.block_manager.cpu_free)


def test_abort_mid_search_frees_everything(engine):
    engine.add_request("x", [5, 6, 7], SamplingParams(max_tokens=MAX_NEW, beam_width=3, ignore_eos=True))
    for _ in range(4):
        engine.step()
    engine.abort("x")
    engine.abort("x")  # idempotent
    outs = [o for o in engine.drain_outputs() if o.request_id == "x"]
    assert len(outs) == 1 and outs[0].finished and outs[0].state == "CANCELLED"
    assert engine.block_manager.blocks_in_use == 0
    assert sum(1 for r in engine.usage_records if r.request_id == "x") == 1


@pytest.mark.parametrize("kw,param", [
    (dict(beam_width=2, n=3), "n"), (dict(beam_width=2, top_p=0.5), "top_p"), (dict(beam_width=0), "beam_width"),
    (dict(beam_width=2, early_stopping="sometimes"), "early_stopping"), (dict(beam_width=2, logprobs=1), "logprobs"),
    (dict(beam_width=2, best_of=2), "best_of")])
def test_invalid_combinations_named(kw, param):
    with pytest.raises(InvalidParameter) as e:
        SamplingParams(**kw).validate(320)
    assert e.value.param == param


def test_beam_needs_a_colocated_worker(engine):
    with pytest.raises(InvalidParameter) as e:
        engine.add_request("p", [5, 6], SamplingParams(beam_width=2), prefill_only=True)
    assert e.value.param == "beam_width"


def test_cli_generate_beam_width(tiny_llama, hf, capsys):
    """`pdserve generate --beam-width B` prints the same best hypotheses transformers finds."""
    import json

    from pdserve.cli import main
    from pdserve.engine.tokenizer import Tokenizer
    prompt = Tokenizer(tiny_llama).encode("the quick brown fox")
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", str(tiny_llama), "--prompt", "the quick brown fox", "--max-tokens", "8",
              "--beam-width", "3", "--n", "2", "--length-penalty", "0.5", "--early-stopping", "never",
              "--dtype", "float32", "--json"])
    assert e.value.code == 0
    got = json.loads(capsys.readouterr().out)["choices"]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), num_beams=3, num_return_sequences=2,
                          do_sample=False, length_penalty=0.5, early_stopping="never", max_new_tokens=8,
                          pad_token_id=1)
    assert [c["token_ids"] for c in got] == [r[len(prompt):].tolist()[:len(c["token_ids"])] for r, c in zip(ref, got)]
    assert all(len(c["token_ids"]) == 8 for c in got)
