"""The simulator's TP follows the engine's sharding rules (engine/tp/shard.py, spec D08), checked by hand."""
import pytest

from pdserve.engine.errors import CheckpointError
from pdserve.sim.costmodel import StepShape
from pdserve.sim.roofline import RooflineCostModel, get_gpu, get_model


def test_kv_split_across_ranks_keeps_the_replica_capacity():
    m, gpu = get_model("llama-3-70b"), get_gpu("H100")  # 8 KV heads over 4 ranks: 2 each
    cm = RooflineCostModel(m, gpu, tp=4)
    per_rank_token = 2 * 80 * 2 * 128 * 2
    assert cm.kv_bytes_per_token_per_rank == per_rank_token
    assert cm.kv_blocks(16) == int((0.9 * 80e9 - m.weight_bytes / 4) // (per_rank_token * 16))


def test_fewer_kv_heads_than_ranks_are_replicated():
    m, gpu = get_model("llama-3-8b"), get_gpu("H100")  # 8 KV heads, 16 ranks: each rank holds one head
    cm = RooflineCostModel(m, gpu, tp=16)
    assert cm.kv_heads_per_rank == 1
    per_rank_token = 2 * 32 * 1 * 128 * 2
    assert cm.kv_blocks(16) == int((0.9 * 80e9 - m.weight_bytes / 16) // (per_rank_token * 16))
    # the replica moves 16 copies' worth of one head per token, twice the unreplicated 8 heads
    s = StepShape(decode_seqs=1, samples=1, sum_context=1000, attn_pairs=1000)
    assert cm.bytes(s) == pytest.approx(m.weight_bytes_read_per_step + 16 * per_rank_token * 1000)


def test_a_degree_the_heads_cannot_split_is_refused_naming_the_shapes():
    with pytest.raises(CheckpointError, match="num_attention_heads=28 is not divisible by tensor_parallel_size=8"):
        RooflineCostModel(get_model("qwen2.5-7b"), get_gpu("H100"), tp=8)


def test_moe_experts_split_over_the_same_ranks():
    """An MoE replica's experts split over its TP ranks (EP = TP, the engine's rule): 128 experts over 3 ranks is
    refused naming the shapes; gpt-oss-120b at TP 4 holds 32 experts a rank, a quarter of the weights."""
    m = get_model("gpt-oss-120b")
    with pytest.raises(CheckpointError, match="128 experts are not divisible by expert_parallel_size=3"):
        RooflineCostModel(m, get_gpu("H100"), tp=3)
    cm = RooflineCostModel(m, get_gpu("H200"), tp=4)
    assert cm.kv_heads_per_rank == 2
    assert cm.kv_blocks(16) == int((0.9 * 141e9 - m.weight_bytes / 4) // (2 * 36 * 2 * 64 * 2 * 16))
