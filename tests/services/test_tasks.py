"""services/tasks.py: a component's owned tasks are held until they end, their failures reach `on_error`, and
close can wait for them (up to a timeout) or cancel them, including tasks started while they are being cancelled."""
import asyncio
import gc

from pdserve.services.tasks import OwnedTasks


def test_held_until_done_and_failures_reported():
    errors: list[BaseException] = []

    async def main():
        tasks = OwnedTasks(on_error=errors.append)
        done = []

        async def quick():
            await asyncio.sleep(0.01)
            done.append(1)

        async def fails():
            raise ValueError("boom")

        tasks.spawn(quick())  # nobody else holds it: the set must
        tasks.spawn(fails())
        gc.collect()
        assert len(tasks) == 2
        await tasks.wait()
        assert done == [1] and len(tasks) == 0

    asyncio.run(main())
    assert [str(e) for e in errors] == ["boom"]


def test_wait_times_out_then_cancel_ends_everything():
    async def main():
        tasks = OwnedTasks()
        cancelled = []

        async def stuck(again: bool):
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.append(again)
                if again:  # cleanup that starts another task while being cancelled
                    tasks.spawn(stuck(False))
                raise

        t = tasks.spawn(stuck(True))
        await tasks.wait(timeout_s=0.05)
        assert not t.done() and len(tasks) == 1  # a timed-out wait leaves them running
        await tasks.cancel()
        assert t.cancelled() and cancelled == [True, False] and len(tasks) == 0

    asyncio.run(main())
