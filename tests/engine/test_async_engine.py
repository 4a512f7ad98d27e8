"""The asyncio front: streamed deltas add up to the batch result; leaving a stream early frees its blocks."""
from __future__ import annotations

import asyncio

from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.engine import Engine, EngineConfig, FirstToken
from pdserve.engine.sampling_params import SamplingParams

P = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def test_stream_and_cancel(tiny_llama):
    eng = Engine.from_pretrained(tiny_llama, EngineConfig(block_size=4, num_gpu_blocks=64))
    expected = eng.generate([[5, 6, 7]], P)[0].outputs[0]

    async def main():
        aeng = AsyncEngine(eng)
        await aeng.start()
        ids, text = [], ""
        async for out in aeng.generate("s", [5, 6, 7], P):
            ids += out.outputs[0].new_token_ids
            text += out.outputs[0].new_text
        assert ids == expected.token_ids and text == expected.text
        agen = aeng.generate("c", list(range(5, 30)), SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
        async for out in agen:
            if len(out.outputs[0].token_ids) >= 3:
                break
        await agen.aclose()
        stats = None
        for _ in range(100):
            stats = await aeng.run(lambda e: e.stats())
            if stats.kv_blocks_in_use == 0:
                break
            await asyncio.sleep(0.01)
        await aeng.stop()
        return stats

    stats = asyncio.run(main())
    assert stats.kv_blocks_in_use == 0
    assert stats.terminal == {"FINISHED": 2, "CANCELLED": 1}


def test_pending_transfer_that_never_completes_is_freed(tiny_llama):
    """Decode side: a remote prefill whose KV never arrives (neither committed nor failed) ends FAILED at its
    transfer deadline and gives its blocks back, also on an otherwise idle engine; a late commit is refused."""
    import time
    eng = Engine.from_pretrained(tiny_llama, EngineConfig(block_size=4, num_gpu_blocks=64))

    async def main():
        aeng = AsyncEngine(eng)
        await aeng.start()
        prompt = list(range(5, 30))
        blocks, cached = await aeng.run(lambda e: e.add_prefilled_request(
            "r", prompt, [FirstToken(7)], P, transfer_deadline=time.time() + 0.3))
        assert cached == 0 and len(blocks) == 7
        held = await aeng.run(lambda e: e.stats())
        assert held.kv_blocks_in_use == 7 and held.states == {"PREFILLING": 1}
        t0 = time.monotonic()
        while (await aeng.run(lambda e: e.stats())).kv_blocks_in_use and time.monotonic() - t0 < 5:
            await asyncio.sleep(0.05)
        freed_after = time.monotonic() - t0
        stats = await aeng.run(lambda e: e.stats())
        late = await aeng.run(lambda e: e.commit_prefilled("r"))
        await aeng.stop()
        return stats, freed_after, late

    stats, freed_after, late = asyncio.run(main())
    assert stats.kv_blocks_in_use == 0 and stats.states == {} and stats.terminal == {"FAILED": 1}
    assert freed_after < 1.0  # deadline 0.3 s + one idle poll (TRANSFER_POLL_S)
    assert late is False
    assert eng.usage_records[-1].request_id == "r" and eng.usage_records[-1].state == "FAILED"


def test_snapshot_is_published_without_a_round_trip(tiny_llama):
    """The stats snapshot follows the engine (a finished request shows up without anyone asking the engine
    thread), and a step in progress is visible as busy time."""
    eng = Engine.from_pretrained(tiny_llama, EngineConfig(block_size=4, num_gpu_blocks=64,
                                                          fault_step_delay_s=0.4))

    async def main():
        aeng = AsyncEngine(eng)
        await aeng.start()
        assert aeng.snapshot.stats.kv_blocks_in_use == 0 and aeng.busy_for() == 0.0
        gen = aeng.generate("s", [5, 6, 7], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        task = asyncio.ensure_future(asyncio.wait_for(_drain(gen), 10))
        await asyncio.sleep(0.25)  # inside the first (slowed) step
        busy = aeng.busy_for()
        await task
        for _ in range(50):
            if aeng.snapshot.stats.terminal.get("FINISHED") == 1:
                break
            await asyncio.sleep(0.02)
        final = aeng.snapshot.stats
        await aeng.stop()
        return busy, final

    busy, final = asyncio.run(main())
    assert 0.1 < busy < 0.4
    assert final.terminal == {"FINISHED": 1} and final.kv_blocks_in_use == 0


async def _drain(gen):
    async for _ in gen:
        pass


def test_concurrent_streams_get_their_own_tokens_with_one_wakeup_per_step(tiny_llama):
    """Eight streams decoding together each receive exactly what the batch API gives for their prompt, in order;
    the engine thread wakes the event loop once per step for all of them (each wake-up is a self-pipe write and
    a GIL hand-off the engine thread waits on), not once per output."""
    eng = Engine.from_pretrained(tiny_llama, EngineConfig(block_size=4, num_gpu_blocks=256, max_num_seqs=8))
    prompts = [[5 + i, 6, 7 + 2 * i] for i in range(8)]
    expected = [o.outputs[0].token_ids for o in eng.generate(prompts, P)]

    async def main():
        loop = asyncio.get_running_loop()
        wakeups = [0]
        orig = loop.call_soon_threadsafe

        def counting(cb, *args, **kw):
            wakeups[0] += 1
            return orig(cb, *args, **kw)

        loop.call_soon_threadsafe = counting
        aeng = AsyncEngine(eng)
        await aeng.start()

        async def one(i):
            ids = []
            async for out in aeng.generate(f"s{i}", prompts[i], P):
                ids += out.outputs[0].new_token_ids
            return ids

        steps0 = eng.num_steps
        got = await asyncio.gather(*[one(i) for i in range(8)])
        steps = eng.num_steps - steps0
        await aeng.stop()
        return got, wakeups[0], steps

    got, wakeups, steps = asyncio.run(main())
    assert got == expected
    # per step at most one delivery; the 8 adds' command results and stray idle wake-ups stay well below the
    # 8 x 16 = 128 a per-output hand-off would take
    assert steps >= 16 and wakeups <= steps + 8 + 8, (wakeups, steps)


def test_step_listeners_see_every_step_in_order(tiny_llama):
    """`add_step_listener`: each listener is called on the engine thread after every step, in the order added,
    with the outputs of that step (the worker's load meter is one)."""
    eng = Engine.from_pretrained(tiny_llama, EngineConfig(block_size=4, num_gpu_blocks=64))
    calls: list[tuple[str, int, int]] = []

    async def main():
        aeng = AsyncEngine(eng)
        aeng.add_step_listener(lambda e, outs: calls.append(("a", e.num_steps, len(outs))))
        aeng.add_step_listener(lambda e, outs: calls.append(("b", e.num_steps, len(outs))))
        await aeng.start()
        async for _ in aeng.generate("s", [5, 6, 7], P):
            pass
        await aeng.stop()

    asyncio.run(main())
    assert calls and [c[0] for c in calls] == ["a", "b"] * (len(calls) // 2)
    assert calls[0::2] == [("a", n, k) for _, n, k in calls[1::2]]  # both saw the same steps and outputs
    assert sum(k for who, _, k in calls if who == "a") >= P.max_tokens  # one output per token step at least
