"""The decode side owns every task it starts: close() waits for them for a grace period, then cancels and awaits
what is left, so nothing outlives the worker's shutdown or is collected mid-flight."""
import asyncio

from pdserve.kv_transfer.layout import KV_PROTOCOL_VERSION, KVLayout
from pdserve.services.decode.service import DecodeSide
from pdserve.services.kv_endpoint import KvEndpoint
from pdserve.services.pb import common_pb2

LAYOUT = KVLayout("fp", 16, "float32", 2, 2, 16)


def _side() -> DecodeSide:
    ep = KvEndpoint("d", "127.0.0.1:1", "inc", KV_PROTOCOL_VERSION, LAYOUT, common_pb2.KvRegion())
    return DecodeSide(host=None, endpoint=ep, agent=None, tokenizer=None, meter=None, transfer_timeout_s=1.0)


def test_close_waits_for_owned_tasks_then_cancels_the_rest():
    async def main():
        side = _side()
        finished, cancelled = [], []

        async def quick():
            await asyncio.sleep(0.05)
            finished.append(1)

        async def stuck():
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.append(1)
                raise

        side._tasks.spawn(quick())
        t = side._tasks.spawn(stuck())
        await side.close(grace_s=0.3)
        assert finished == [1] and cancelled == [1] and t.cancelled()
        assert len(side._tasks) == 0  # nothing left behind

    asyncio.run(main())


def test_no_unowned_futures_in_the_worker_parts():
    """Every task in the prefill and decode parts goes through an owning set (services/tasks.py)."""
    from pathlib import Path

    import pdserve.services.decode.service as d
    import pdserve.services.prefill.service as p
    for mod in (d, p):
        src = Path(mod.__file__).read_text()
        assert "ensure_future(" not in src and "run_coroutine_threadsafe(" not in src, mod.__name__
