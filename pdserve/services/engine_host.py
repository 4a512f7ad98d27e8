"""Async front of a synchronous Engine: the step loop runs in its own thread, asyncio code talks to it through
`run(fn)` (fn(engine) executed between steps) and per-request output queues.

This implements the AsyncEngine contract (generate / abort / run / start / stop) plus `open_stream`, which the
decode path needs: outputs of a request admitted with `add_prefilled_request` must reach a queue that exists
before `commit_prefilled` runs. When `pdserve.engine.async_engine.AsyncEngine` offers the same, workers can
switch to it; until then this is the one place that touches the engine from another thread.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import AsyncIterator, Callable

from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sampling_params import SamplingParams

log = logging.getLogger("pdserve.engine_host")


class EngineHost:
    def __init__(self, engine):
        self.engine = engine
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.dead: BaseException | None = None  # set when the step loop crashed: the worker is unhealthy

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._main, name="engine-step", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread:
            await asyncio.to_thread(self._thread.join, 10)

    # ---- engine thread ----------------------------------------------------------------------------------------
    def _main(self) -> None:
        eng = self.engine
        try:
            while not self._stopping:
                self._wake.clear()
                while True:
                    try:
                        fn, fut = self._cmds.get_nowait()
                    except queue.Empty:
                        break
                    try:
                        res = fn(eng)
                        self._loop.call_soon_threadsafe(_set_result, fut, res)
                    except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
                        self._loop.call_soon_threadsafe(_set_exc, fut, e)
                if eng.has_unfinished():
                    outs = eng.step()
                    if outs:
                        self._loop.call_soon_threadsafe(self._dispatch, outs)
                    else:
                        self._wake.wait(0.002)  # nothing schedulable right now (e.g. waiting for blocks)
                else:
                    self._wake.wait(0.05)
        except BaseException as e:  # noqa: BLE001
            log.exception("engine step loop crashed")
            self.dead = e
            self._loop.call_soon_threadsafe(self._fail_all, repr(e))

    def _dispatch(self, outs: list[RequestOutput]) -> None:
        for out in outs:
            q = self._streams.get(out.request_id)
            if q is not None:
                q.put_nowait(out)
                if out.finished:
                    self._streams.pop(out.request_id, None)

    def _fail_all(self, why: str) -> None:
        for rid, q in list(self._streams.items()):
            q.put_nowait(RequestOutput(rid, [], [], True, "FAILED", error=f"engine crashed: {why}"))
        self._streams.clear()

    # ---- asyncio side -----------------------------------------------------------------------------------------
    async def run(self, fn: Callable):
        if self.dead is not None:
            raise RuntimeError(f"engine is dead: {self.dead!r}")
        fut = self._loop.create_future()
        self._cmds.put((fn, fut))
        self._wake.set()
        return await fut

    def run_nowait(self, fn: Callable) -> None:
        """Fire and forget (usable from finally blocks of cancelled tasks and from other threads)."""
        self._cmds.put((fn, _SINK))
        self._wake.set()

    async def abort(self, request_id: str, state: str = "CANCELLED") -> None:
        await self.run(lambda e: e.abort(request_id, state))

    def open_stream(self, request_id: str) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = q
        return q

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    @staticmethod
    async def drain(q: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        while True:
            out = await q.get()
            yield out
            if out.finished:
                return

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       namespace: str = "", prefill_only: bool = False,
                       arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """Output deltas until finished; closing/cancelling the iterator early aborts the request."""
        q = self.open_stream(request_id)
        finished = False
        try:
            await self.run(lambda e: e.add_request(request_id, prompt_token_ids, params, namespace=namespace,
                                                   prefill_only=prefill_only, arrival_time=arrival_time))
            async for out in self.drain(q):
                finished = out.finished
                yield out
        finally:
            self.close_stream(request_id)
            if not finished:
                self.run_nowait(lambda e: e.abort(request_id, "CANCELLED"))


class _Sink:
    """Stands in for a future nobody awaits (results and errors of fire-and-forget commands are dropped)."""

    def done(self) -> bool:
        return True


_SINK = _Sink()


def _set_result(fut, res) -> None:
    if not fut.done():
        fut.set_result(res)


def _set_exc(fut, e) -> None:
    if not fut.done():
        fut.set_exception(e)
