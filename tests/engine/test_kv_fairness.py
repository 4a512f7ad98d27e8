"""Tenant-fair prefix-cache eviction (spec Q22, docs/engine.md "Tenant-fair eviction"): a noisy tenant's churn
never evicts a quiet tenant's cached blocks below the quiet tenant's guaranteed share; above it they are
borrowable. Real BlockManager, then a real Engine on the tiny checkpoint."""
from __future__ import annotations

import random

import pytest

from pdserve.engine.block_manager import BlockManager, NoFreeBlocks
from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Sequence

QUIET, NOISY = "tenant:quiet", "tenant:noisy"
_ids = iter(range(1, 10**9))


def seq(tokens, ns):
    return Sequence(next(_ids), f"r{next(_ids)}", list(tokens), ns)


def run_once(bm: BlockManager, tokens, ns) -> int:
    """Prefill `tokens` in namespace ns (prefix hits reused), register its full blocks, finish: returns the hit."""
    s = seq(tokens, ns)
    hits = bm.lookup(s)
    bm.allocate(s, s.num_tokens - len(hits) * bm.block_size, hits)
    s.num_computed_tokens = s.num_tokens
    bm.mark_computed(s)
    bm.free(s)
    return len(hits)


def churn(bm: BlockManager, n: int, start: int = 1000) -> None:
    for i in range(n):  # distinct 17-token prompts: 4 full blocks + 1 partial each
        run_once(bm, range(start + 17 * i, start + 17 * (i + 1)), NOISY)


def quiet_prompt(k: int):
    return [7 + k] * 16 + [3]  # 4 full blocks of 4 + the last token


@pytest.mark.parametrize("share", [0.0, 0.25])
def test_quiet_prefix_survives_noisy_churn(share):
    bm = BlockManager(16, 4)
    bm.set_share(QUIET, share)
    assert run_once(bm, quiet_prompt(0), QUIET) == 0
    churn(bm, 20)
    hit = len(bm.lookup(seq(quiet_prompt(0), QUIET)))
    if share == 0:
        assert hit == 0  # plain LRU: the noisy tenant's churn pushed it out (so the protected case can fail)
    else:
        assert hit == 4  # floor(0.25 x 16) = 4 blocks guaranteed: all four survive
        assert bm.shares.held[QUIET] == 4
        assert bm.num_free_for(NOISY) == 12 and bm.num_free == 16
    assert bm.blocks_in_use == 0


def test_surplus_above_share_is_borrowed_back_lru_first():
    bm = BlockManager(16, 4)
    bm.set_share(QUIET, 0.25)  # 4 blocks
    run_once(bm, quiet_prompt(0), QUIET)  # older: evicted first
    run_once(bm, quiet_prompt(1), QUIET)
    assert bm.shares.held[QUIET] == 8
    churn(bm, 20)
    assert bm.shares.held[QUIET] == 4  # down to its share, not below
    assert len(bm.lookup(seq(quiet_prompt(0), QUIET))) == 0
    assert len(bm.lookup(seq(quiet_prompt(1), QUIET))) == 4


def test_noisy_uses_everything_when_quiet_holds_nothing():
    bm = BlockManager(16, 4)
    bm.set_share(QUIET, 0.5)
    assert bm.num_free_for(NOISY) == 16
    s = seq(range(64), NOISY)  # all 16 blocks
    assert bm.can_allocate(s, 64)
    bm.allocate(s, 64)
    assert bm.num_free == 0
    bm.free(s)


def test_protected_blocks_refuse_other_namespaces_until_valve():
    bm = BlockManager(16, 4)
    bm.set_share(QUIET, 0.25)
    run_once(bm, quiet_prompt(0), QUIET)  # 4 protected cached blocks
    s = seq(range(100, 148), NOISY)  # 12 blocks: fits beside them
    bm.allocate(s, 48)
    t = seq(range(200, 204), NOISY)  # one more block would have to evict a protected one
    assert not bm.can_allocate(t, 4)
    with pytest.raises(NoFreeBlocks):
        bm.allocate(t, 4)
    assert bm.shares.held[NOISY] == 12  # the refused allocation left nothing behind
    bm.free(s)
    # liveness valve: a sequence larger than what others' guarantees leave (16 - 4) is not held to them
    big = seq(range(300, 356), NOISY)  # 14 blocks
    assert bm.can_allocate(big, 56)
    bm.allocate(big, 56)
    assert bm.shares.held[QUIET] == 2  # the 12 free blocks first, then only the 2 protected ones it lacked
    bm.free(big)
    # and the counters stay exact through all of it
    assert sum(bm.shares.held.values()) == bm.num_blocks - len(bm.free_ids)
    assert sum(bm.shares.cached.values()) == len(bm.evictable)


def test_own_churn_evicts_own_blocks():
    bm = BlockManager(8, 4)
    bm.set_share(QUIET, 0.5)
    for k in range(5):  # quiet churns by itself: its own blocks rotate, nothing raises
        run_once(bm, quiet_prompt(k), QUIET)
    assert len(bm.lookup(seq(quiet_prompt(4), QUIET))) == 4


GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.mark.parametrize("share", [0.0, 0.35])
def test_engine_quiet_prefix_survives_noisy_tenant(tiny_llama, share):
    """Real engine, 24 blocks of 4: a quiet tenant's 33-token prompt (8 full blocks), then a noisy tenant sends
    batches of distinct prompts that need every block; the quiet tenant's second request hits its prefix and
    generates the same tokens."""
    eng = Engine.from_pretrained(tiny_llama, EngineConfig(block_size=4, num_gpu_blocks=24))
    if share:
        eng.set_tenant_share(QUIET, share)  # floor(0.35 x 24) = 8
    rng = random.Random(0)
    vocab = eng.model_config.vocab_size
    quiet = [rng.randrange(vocab) for _ in range(33)]
    first = eng.generate([quiet], GREEDY, namespace=QUIET)[0]
    for _ in range(4):
        eng.generate([[rng.randrange(vocab) for _ in range(26)] for _ in range(3)], GREEDY, namespace=NOISY)
    again = eng.generate([quiet], GREEDY, namespace=QUIET)[0]
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert again.num_cached_tokens == (32 if share else 0)
    assert eng.block_manager.blocks_in_use == 0


def test_share_travels_in_the_lifecycle(tiny_llama):
    """The gateway puts the tenant's kv_share into the request's Lifecycle; the worker records it for the
    request's namespace in the engine thread before the request is added (services/convert.py)."""
    import asyncio

    from pdserve._proto.pdserve.v1 import common_pb2
    from pdserve.engine.async_engine import AsyncEngine
    from pdserve.services.convert import lifecycle_to_pb, limits_from_pb

    wire = lifecycle_to_pb(None, 1, None, 0.35).SerializeToString()
    lim = limits_from_pb(common_pb2.Lifecycle.FromString(wire))
    assert lim.kv_share == 0.35
    assert limits_from_pb(lifecycle_to_pb(None, 1, None)).kv_share is None  # no share: nothing is recorded
    eng = Engine.from_pretrained(tiny_llama, EngineConfig(block_size=4, num_gpu_blocks=24))

    async def main():
        aeng = AsyncEngine(eng)
        await aeng.start()
        try:
            lim.apply_share(aeng, QUIET)
            async for _ in aeng.generate("r", [5, 6, 7, 8, 9], GREEDY, namespace=QUIET):
                pass
            return await aeng.run(lambda e: dict(e.block_manager.shares.share))
        finally:
            await aeng.stop()

    assert asyncio.run(main()) == {QUIET: 0.35}


def test_share_set_to_zero_lifts_the_protection():
    bm = BlockManager(16, 4)
    bm.set_share(QUIET, 0.25)
    run_once(bm, quiet_prompt(0), QUIET)
    bm.set_share(QUIET, 0.0)  # the keys file lowered it: the gateway sends 0 with the next request
    assert not bm.shares.active and bm.num_free_for(NOISY) == 16
    churn(bm, 20)
    assert len(bm.lookup(seq(quiet_prompt(0), QUIET))) == 0
