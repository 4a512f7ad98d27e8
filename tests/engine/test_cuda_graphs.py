"""CUDA-graph bucketing and padding (pure functions, on CPU), and the claim padding rests on: a decode batch padded
with copies of its first row gives the same logits for the real rows and writes nothing new into the KV pool."""
from __future__ import annotations

import pytest
import torch

from pdserve.engine.attention import AttentionMetadata, NativeDecode
from pdserve.engine.cuda_graphs import DecodeInputs, bucket_for, capture_sizes, pad_decode


@pytest.mark.parametrize("max_num_seqs,want", [
    (1, [1]), (3, [1, 2, 4]), (8, [1, 2, 4, 8]), (10, [1, 2, 4, 8, 16]),
    (64, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]), (0, [])])
def test_capture_sizes(max_num_seqs, want):
    assert capture_sizes(max_num_seqs) == want


def test_capture_sizes_capped():
    sizes = capture_sizes(4096, largest=32)
    assert sizes == [1, 2, 4, 8, 16, 24, 32]


@pytest.mark.parametrize("n,want", [(1, 1), (3, 4), (5, 8), (9, 16), (16, 16), (17, None), (0, None)])
def test_bucket_for(n, want):
    assert bucket_for(n, [1, 2, 4, 8, 16]) == want


def inputs(n: int, width: int) -> DecodeInputs:
    return DecodeInputs(input_ids=torch.arange(10, 10 + n), positions=torch.arange(20, 20 + n),
                        slot_blocks=torch.arange(30, 30 + n), slot_offsets=torch.arange(n) % 4,
                        block_tables=torch.arange(n * width).view(n, width) + 1,
                        context_lens=torch.arange(40, 40 + n))


def test_pad_decode_repeats_first_row_and_widens_tables():
    real = inputs(3, 2)
    p = pad_decode(real, 8, 5)
    assert p.batch == 8 and p.block_tables.shape == (8, 5)
    assert p.input_ids.tolist() == [10, 11, 12, 10, 10, 10, 10, 10]
    assert p.positions.tolist() == [20, 21, 22] + [20] * 5
    assert p.slot_blocks.tolist() == [30, 31, 32] + [30] * 5
    assert p.slot_offsets.tolist() == [0, 1, 2] + [0] * 5
    assert p.context_lens.tolist() == [40, 41, 42] + [40] * 5
    assert p.block_tables.tolist() == [[1, 2, 0, 0, 0], [3, 4, 0, 0, 0], [5, 6, 0, 0, 0]] + [[1, 2, 0, 0, 0]] * 5


@pytest.mark.parametrize("n,size,width", [(0, 4, 2), (5, 4, 2), (2, 4, 1)])
def test_pad_decode_rejects(n, size, width):
    with pytest.raises(ValueError):
        pad_decode(inputs(n, 2) if n else _empty(), size, width)


def _empty() -> DecodeInputs:
    z = torch.zeros(0, dtype=torch.long)
    return DecodeInputs(z, z, z, z, torch.zeros((0, 2), dtype=torch.long), z)


def test_padded_decode_equals_unpadded(tiny_llama):
    """Through the engine's model and pool on CPU: real rows' logits match the unpadded step, the pool after the
    padded step equals the pool after the unpadded one, and no block outside the batch's slots changed."""
    from pdserve.engine.engine import Engine, EngineConfig
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.engine.scheduler import ScheduledSeq

    engine = Engine.from_pretrained(tiny_llama, EngineConfig(num_gpu_blocks=64, block_size=4))
    if engine.runner.attention_ops is None:
        pytest.skip("no in-place attention kernel on this host (native kernels unavailable)")
    prompts = [[5, 6, 7, 8, 9], [12, 13], list(range(20, 33))]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    seqs = [engine.requests[f"r{i}"].seqs[0] for i in range(len(prompts))]
    while any(s.num_output_tokens == 0 for s in seqs):
        engine.step()
    for s in seqs:
        engine.block_manager.allocate(s, 1)
    ids, pos, meta, rows, _ = engine.runner.prepare([ScheduledSeq(s, 1) for s in seqs])
    nd = meta.native_decode
    assert nd is not None and rows.tolist() == [0, 1, 2]
    before = engine.kv_cache.data.clone()

    kv_a = before.clone()
    logits_a = engine.runner.model(ids, pos, kv_a, meta, rows)

    p = pad_decode(DecodeInputs(ids, pos, meta.slot_blocks, meta.slot_offsets, nd.block_tables, nd.context_lens),
                   8, 16)
    rows8 = torch.arange(8)
    meta_p = AttentionMetadata(slot_blocks=p.slot_blocks, slot_offsets=p.slot_offsets, prefills=[], decodes=[],
                               native_decode=NativeDecode(rows8, p.block_tables, p.context_lens),
                               native_ops=engine.runner.attention_ops, sliding_window=None)
    kv_b = before.clone()
    logits_b = engine.runner.model(p.input_ids, p.positions, kv_b, meta_p, rows8)

    torch.testing.assert_close(logits_b[:3], logits_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits_b[3:], logits_a[[0] * 5], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv_b, kv_a, atol=1e-6, rtol=1e-6)
    written = torch.zeros(before.shape[0], dtype=torch.bool)
    written[meta.slot_blocks] = True
    assert torch.equal(kv_b[~written], before[~written])


class EagerBuckets:
    """What DecodeGraphs.run computes (pad to the bucket, one forward over the padded batch, the real rows'
    logits), run eagerly: CPU stands in for graph replay. Records the sizes it ran."""

    def __init__(self, runner, sizes: list[int], width: int):
        self.runner, self.sizes, self.width, self.ran = runner, sizes, width, []

    def bucket(self, n: int) -> int | None:
        return bucket_for(n, self.sizes)

    def run(self, inputs: DecodeInputs) -> torch.Tensor:
        size = self.bucket(inputs.batch)
        p = pad_decode(inputs, size, self.width)
        rows = torch.arange(size)
        meta = AttentionMetadata(slot_blocks=p.slot_blocks, slot_offsets=p.slot_offsets, prefills=[], decodes=[],
                                 native_decode=NativeDecode(rows, p.block_tables, p.context_lens),
                                 native_ops=self.runner.attention_ops, sliding_window=self.runner.sliding_window)
        self.ran.append((inputs.batch, size))
        return self.runner.model(p.input_ids, p.positions, self.runner.kv.data, meta, rows)[:inputs.batch]


def test_decode_steps_through_buckets_match_transformers(tiny_llama):
    """The runner's graph route (all-decode steps up to the largest size; prefill steps and larger batches eager)
    with padding, on CPU: greedy tokens equal transformers'."""
    import transformers as tf

    from pdserve.engine.engine import Engine, EngineConfig
    from pdserve.engine.sampling_params import SamplingParams

    engine = Engine.from_pretrained(tiny_llama, EngineConfig(num_gpu_blocks=96, block_size=4))
    if engine.runner.attention_ops is None:
        pytest.skip("no in-place attention kernel on this host (native kernels unavailable)")
    fake = EagerBuckets(engine.runner, [1, 2, 4], width=-(-engine.model_config.max_model_len // 4))
    engine.runner.graphs = fake
    hf = tf.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()

    def run_and_compare(prompts):
        outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        for prompt, out in zip(prompts, outs):
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()
            assert out.outputs[0].token_ids == ref

    run_and_compare([[5, 6, 7, 8, 9, 10, 11], list(range(20, 61)), [3]])  # 3 decodes: padded to 4
    assert fake.ran and all(ran == (3, 4) for ran in fake.ran), fake.ran
    steps = len(fake.ran)
    run_and_compare([[12, 13], [40, 41, 42], [7], [9, 10], list(range(60, 70))])  # 5 > 4: eager
    assert len(fake.ran) == steps
