"""The asyncio front: streamed deltas add up to the batch result; leaving a stream early frees its blocks."""
from __future__ import annotations

import asyncio

from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.engine import Engine, EngineConfig
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
            if stats["kv_blocks_in_use"] == 0:
                break
            await asyncio.sleep(0.01)
        await aeng.stop()
        return stats

    stats = asyncio.run(main())
    assert stats["kv_blocks_in_use"] == 0
    assert stats["terminal"] == {"FINISHED": 2, "CANCELLED": 1}
