"""A real Worker around a real engine switching role in process (services/worker.py switch_role): a worker started
as `both` (no KV transfer agent) gets one for a disaggregated role, with its region published in its KV endpoint;
the drain waits for what the worker holds, and past its timeout the switch is undone, the old role kept."""
import asyncio

from pdserve.engine.engine import Engine, EngineConfig
from pdserve.services.metrics import worker as M


def _count(old, new, outcome):
    return M.ROLE_SWITCHES.labels(old, new, outcome)._value.get()


def test_both_to_prefill_to_decode_and_back(tiny_llama):
    from pdserve.services.worker import Worker
    eng = Engine.from_pretrained(tiny_llama, EngineConfig(block_size=4, num_gpu_blocks=32))

    async def main():
        w = Worker(eng, "both", "sw", "127.0.0.1:1")
        await w.host.start()
        await w.prefill.start()
        try:
            assert w.agent is None and not w.endpoint.region.agent_name
            n0 = _count("both", "prefill", "switched")
            r = await w.switch_role("prefill", 5.0)
            assert (r.switched, r.role, w.role, w.record().role) == (True, "prefill", "prefill", "prefill")
            assert w.agent is not None and w.endpoint.region.agent_name == w.agent.name
            assert w.decode.agent is w.agent and w.prefill.agent is w.agent
            assert _count("both", "prefill", "switched") == n0 + 1
            # held work delays the switch; the drain waits for it, at least the settle time
            w.inflight += 1
            asyncio.get_running_loop().call_later(0.5, lambda: setattr(w, "inflight", w.inflight - 1))
            r = await w.switch_role("decode", 5.0)
            assert r.switched and r.role == "decode" and r.drained_requests == 1 and r.drain_s >= 0.45, r
            # past the drain timeout: undone, the old role serves again
            w.inflight += 1
            r = await w.switch_role("both", 0.2)
            assert (r.switched, r.role, w.role, w.switch.accepts_work) == (False, "decode", "decode", True), r
            assert "drain timeout" in r.error
            w.inflight -= 1
            r = await w.switch_role("both", 5.0)
            assert r.switched and w.role == "both" and w.record().role == "both"
        finally:
            await w.decode.close()
            await w.prefill.stop()
            await w.host.stop()
            if w.agent is not None:
                w.agent.close()

    asyncio.run(main())
