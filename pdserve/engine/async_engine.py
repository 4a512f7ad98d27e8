"""asyncio front of the engine: the step loop runs in its own thread; callers await outputs per request.

Every engine call from the event loop is queued and executed by the engine thread between two steps, so the
engine itself needs no locks. Cancelling a `generate` iterator aborts its request within one tick.

Backpressure (spec §1.4): each request's output buffer is bounded. The engine thread counts outputs delivered,
the consumer counts outputs taken (one writer each, so no lock); when a request has
`max_buffered_outputs` undelivered outputs it is paused (BACKPRESSURED: no decode steps), and resumed once its
consumer has drained to half. The chain of pull-based streams (SSE -> gateway -> gRPC -> here) carries a slow
client's backpressure down to this buffer.

Readers that must never wait behind a step (the registry heartbeat) read `snapshot`: engine stats the engine
thread publishes between steps, plus how long the thread has been inside its current step or command.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.engine import Engine
from pdserve.engine.grammar_pool import GrammarPool
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.stats import EngineStats

# While a remote prefill's KV is awaited, an idle engine thread wakes this often to check transfer deadlines.
TRANSFER_POLL_S = 0.25
# Stats are republished at most this often while the engine is busy (always before it goes idle).
SNAPSHOT_INTERVAL_S = 0.1
# Called after each step with the engine and the outputs it produced (AsyncEngine.add_step_listener).
StepListener = Callable[[Engine, list[RequestOutput]], None]


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine.stats() as of `published` (time.monotonic()); replaced whole, never mutated, so any thread may
    read the current one without a lock."""

    stats: EngineStats = field(default_factory=EngineStats)
    published: float = 0.0


class AsyncEngine:
    def __init__(self, engine: Engine, grammars: GrammarPool | None = None):
        """`grammars`: where constraints compile (a serving worker's pool, never the engine thread); None: the
        engine compiles them inline (tests, tools)."""
        self.engine = engine
        self.grammars = grammars
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, asyncio.Queue] = {}
        self._delivered: dict[str, int] = {}  # written by the engine thread only
        self._consumed: dict[str, int] = {}  # written by the event loop only
        self._paused: set[str] = set()  # engine thread only
        self._wake = threading.Event()  # set with every command: ends an idle wait early
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._step_listeners: list[StepListener] = []  # add_step_listener; called on the engine thread
        self._hook_backlog: list[RequestOutput] = []  # delivered between steps, shown to the listeners at the next
        self.snapshot = EngineSnapshot()
        self._busy_since: float | None = None  # monotonic start of the step/command running now (engine thread)

    def add_step_listener(self, fn: StepListener) -> None:
        """Call `fn(engine, outputs)` on the engine thread after every step, in the order added (metrics: it may
        read the engine, and must be quick). `outputs` also holds what commands delivered since the last step."""
        self._step_listeners.append(fn)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._publish()  # the thread is not running yet: the engine is ours to read
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stopping = True
        self._commands.put(None)
        if self._thread:
            await asyncio.to_thread(self._thread.join, 10)

    # ---- engine thread ----------------------------------------------------------------------------------------
    def _run(self) -> None:
        last_publish = 0.0
        while not self._stopping:
            block = not self.engine.has_unfinished()
            now = time.monotonic()
            if block or now - last_publish >= SNAPSHOT_INTERVAL_S:
                self._publish()  # before going idle, so what an idle engine shows is never stale
                last_publish = now
            # Idle but for remote prefills whose KV is still awaited: wake now and then for their deadlines.
            timeout = TRANSFER_POLL_S if block and self.engine.has_pending_transfers() else None
            try:
                while True:
                    cmd = self._commands.get(block=block, timeout=timeout if block else 0)
                    block = False
                    if cmd is None:
                        if self._stopping:
                            return
                        continue
                    fn, fut = cmd
                    self._busy_since = time.monotonic()
                    try:
                        result = fn(self.engine)
                    except BaseException as e:  # hand the error to the awaiting caller
                        self._resolve(fut, None, e)
                    else:
                        self._resolve(fut, result, None)
                    finally:
                        self._busy_since = None
            except queue.Empty:
                pass
            self.engine.expire_transfers(time.time())
            # Deliver what commands produced (a committed prefill's first token, aborts) now; the step listeners
            # still see them, with the next step's outputs (it times steps by its calls).
            pending = self.engine.drain_outputs()
            self._hook_backlog += pending
            self._deliver(pending)
            if self.engine.has_unfinished():
                self._backpressure()
                steps = self.engine.num_steps
                self._busy_since = time.monotonic()
                try:
                    outputs = self.engine.step()
                except Exception as e:  # a failed step fails its requests, not the worker
                    outputs = self._fail_all(e)
                finally:
                    self._busy_since = None
                if self._step_listeners:
                    seen = self._hook_backlog + outputs
                    for fn in self._step_listeners:
                        fn(self.engine, seen)
                self._hook_backlog = []
                self._deliver(outputs)
                if self.engine.num_steps == steps and not outputs:
                    self._idle_wait()

    def _publish(self) -> None:
        self.snapshot = EngineSnapshot(self.engine.stats(), time.monotonic())

    def busy_for(self) -> float:
        """Seconds the engine thread has been inside its current step or command (0 between them or idle).
        Any thread may call it: a worker whose engine is wedged must stop advertising itself."""
        since = self._busy_since
        return 0.0 if since is None else max(0.0, time.monotonic() - since)

    def _idle_wait(self) -> None:
        """Nothing could run (all requests backpressured or waiting for blocks): wait for a command or a few ms
        instead of spinning a core (deadlines and drained buffers are checked again after)."""
        self._wake.wait(0.005)
        self._wake.clear()

    def _backpressure(self) -> None:
        limit = self.engine.config.max_buffered_outputs
        for rid in list(self._delivered):
            if rid not in self._streams:  # its consumer left: the abort that follows reclaims it
                self._delivered.pop(rid, None)
                self._paused.discard(rid)
                continue
            buffered = self._delivered.get(rid, 0) - self._consumed.get(rid, 0)
            if rid not in self._paused and buffered >= limit:
                if self.engine.set_paused(rid, True):
                    self._paused.add(rid)
            elif rid in self._paused and buffered <= limit // 2:
                self.engine.set_paused(rid, False)
                self._paused.discard(rid)

    def _fail_all(self, err: Exception) -> list[RequestOutput]:
        import logging
        logging.getLogger("pdserve.engine").exception("engine step failed; failing its requests")
        for rid in list(self.engine.requests):
            self.engine.abort(rid, "FAILED")
        outs = self.engine.step() if self.engine.has_unfinished() else []
        for o in outs:
            o.error = f"engine step failed: {err}"
        return outs

    def _resolve(self, fut: asyncio.Future | None, result: Any, err: BaseException | None) -> None:
        if fut is None:
            return

        def done() -> None:
            if fut.done():
                return
            if err is not None:
                fut.set_exception(err)
            else:
                fut.set_result(result)

        self._loop.call_soon_threadsafe(done)

    def _deliver(self, outs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their streams with one wake-up of the event loop. Each
        `call_soon_threadsafe` writes the loop's self-pipe and contends for the GIL: one per output cost a
        16-request decode batch ~16% of the engine thread's time (py-spy, built-in model, 1 thread)."""
        batch = []
        for out in outs:
            rid = out.request_id
            q = self._streams.get(rid)
            if q is None:
                continue
            if out.finished:
                self._delivered.pop(rid, None)
                self._paused.discard(rid)
            else:
                self._delivered[rid] = self._delivered.get(rid, 0) + 1
            batch.append((q, out))
        if batch:
            self._loop.call_soon_threadsafe(_put_all, batch)

    # ---- event-loop side --------------------------------------------------------------------------------------
    async def run(self, fn: Callable[[Engine], Any]) -> Any:
        """Run fn(engine) in the engine thread between steps and return its result."""
        fut = self._loop.create_future()
        self._commands.put((fn, fut))
        self._wake.set()
        return await fut

    def submit(self, fn: Callable[[Engine], Any]) -> None:
        """Fire and forget (usable from any thread)."""
        self._commands.put((fn, None))
        self._wake.set()

    async def abort(self, request_id: str, state: str = "CANCELLED") -> None:
        await self.run(lambda e: e.abort(request_id, state))

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                       namespace: str = "", prefill_only: bool = False,
                       arrival_time: float | None = None, deadline: float | None = None, priority: int = 0,
                       predicted_output_tokens: int | None = None,
                       resume_token_ids: list[int] | None = None) -> AsyncIterator[RequestOutput]:
        grammar = await self.compile_grammar(params, deadline)  # before the request holds anything
        stream = self.attach(request_id)
        try:
            await self.run(lambda e: e.add_request(request_id, prompt_token_ids, params, namespace=namespace,
                                                   prefill_only=prefill_only, arrival_time=arrival_time,
                                                   deadline=deadline, priority=priority,
                                                   predicted_output_tokens=predicted_output_tokens,
                                                   resume_token_ids=resume_token_ids, grammar=grammar))
        except asyncio.CancelledError:
            # the add is queued and will run: undo it behind it (commands run in order), or the request would
            # compute (and a prefill-only one stay pinned) for nobody
            self.detach(request_id)
            self.submit(lambda e: e.abort(request_id, "CANCELLED"))
            raise
        except BaseException:  # refused (ValueError: invalid, or a duplicate id that is someone else's)
            self.detach(request_id)
            raise
        async for out in stream:
            yield out

    async def compile_grammar(self, params: SamplingParams, deadline: float | None):
        """`params.guided` compiled by the pool, or None (unconstrained, or no pool: the engine compiles inline).
        Raises InvalidParameter or grammar_pool.CompileTimeout; cancelling the await stops the compile."""
        if params.guided is None or self.grammars is None:
            return None
        return await self.grammars.compile(params.guided, deadline)

    def detach(self, request_id: str) -> None:
        """Forget a request's output queue. For a caller that attached but never iterated (a never-started
        iterator's cleanup does not run); idempotent. Does not abort: the caller does that explicitly."""
        self._streams.pop(request_id, None)
        self._consumed.pop(request_id, None)

    def attach(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """Register for a request's outputs now (before it is added or committed, so nothing is missed) and
        return the iterator over them; leaving the iterator early aborts the request."""
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = q
        self._consumed[request_id] = 0
        return self._drain(request_id, q)

    async def _drain(self, request_id: str, q: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                out = await q.get()
                self._consumed[request_id] = self._consumed.get(request_id, 0) + 1
                if request_id in self._paused:
                    self._wake.set()  # a parked request may be resumable now
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            self._consumed.pop(request_id, None)
            if not finished:  # consumer went away (disconnect, cancel): free everything now
                self.submit(lambda e: e.abort(request_id, "CANCELLED"))


def _put_all(batch: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, out in batch:
        q.put_nowait(out)
