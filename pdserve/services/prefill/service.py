"""Prefill side: run prefill, sample the first token, pin the prompt's KV under a lease, hand out a KvHandle.

Pinned blocks are freed by whichever comes first: the decode worker's ReleaseKV RPC, the NIXL notification the
decode worker attaches to its READ (message = lease id), or lease expiry (decode worker died / never pulled).
All three go through `release`, which is idempotent.

The gateway also sends ReleaseKV (by request id) when its client leaves before the decode pickup, which can be
before this worker has a lease to release: while the Prefill still runs (the request is aborted now and the
Prefill answers CANCELLED instead of pinning), or before the Prefill call even arrived (remembered for a lease
TTL, so that call is refused). A Prefill that ends any other way without handing its KV over (cancelled, failed)
gives its blocks back in its `finally`, wherever the engine had got to.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc

from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.grammar_pool import CompileTimeout
from pdserve.kv_transfer.layout import KVLayout, KVLayoutMismatch, check_compatible
from pdserve.kv_transfer.lease import Lease, LeaseTable, reap_forever
from pdserve.services.convert import (
    DeltaEncoder,
    fill_times,
    full_response,
    layout_from_pb,
    limits_from_pb,
    params_from_pb,
)
from pdserve.services.grpc_util import abort_compile_timeout
from pdserve.services.kv_endpoint import KvEndpoint
from pdserve.services.metrics import worker as M
from pdserve.services.pb import worker_pb2
from pdserve.services.refusal import refuse_invalid
from pdserve.services.tasks import OwnedTasks

if TYPE_CHECKING:
    from pdserve.kv_transfer.agent import KVAgent

log = logging.getLogger("pdserve.prefill")

# Early releases remembered at most (a client could send ReleaseKV for ids that never come)
MAX_EARLY_RELEASES = 10_000


class PrefillSide:
    def __init__(self, host: AsyncEngine, endpoint: KvEndpoint, agent: KVAgent | None,
                 pinned_kv: Callable[[str], tuple[list[int], int]], tokenizer, lease_ttl_s: float):
        self.host = host
        self.endpoint = endpoint
        self.agent = agent
        # (block ids, tokens) the engine pinned for a request: read from the event loop, not through the engine
        # thread (the entry is filed before the final output is delivered; only a release changes it)
        self.pinned_kv = pinned_kv
        self.tokenizer = tokenizer
        self.leases = LeaseTable(ttl_s=lease_ttl_s)
        self._reaper: asyncio.Task | None = None
        self._running: set[str] = set()  # request ids whose Prefill call is in progress
        # request id -> expiry (time.time()): ReleaseKV came before the Prefill could pin anything
        self._released_early: dict[str, float] = {}
        self._tasks = OwnedTasks()  # releases for replies that never reached the caller

    async def start(self) -> None:
        self._start_pump()
        self._reaper = asyncio.create_task(reap_forever(self.leases, self._free, interval_s=0.25,
                                                        on_reaped=lambda l: M.LEASES_EXPIRED.inc()))

    def _start_pump(self) -> None:
        loop = asyncio.get_running_loop()

        def on_notif(msg: bytes) -> None:  # NIXL pump thread: the decode side finished its READ
            loop.call_soon_threadsafe(self._release_soon, msg.decode(errors="replace"))

        if self.agent is not None:
            # fast polling only while leases are out: an idle pump would slow this worker's prefill forwards
            self.agent.start_pump(on_notif, active=lambda: len(self.leases) > 0)

    def attach_agent(self, agent: KVAgent, endpoint: KvEndpoint) -> None:
        """A worker that started without a KV transfer agent (role both) takes a prefill role: serve with it."""
        self.agent, self.endpoint = agent, endpoint
        self._start_pump()

    def _release_soon(self, lease_id: str) -> None:
        """A release in a task this side owns (stop() awaits it)."""
        self._tasks.spawn(self.release(lease_id=lease_id))

    async def stop(self) -> None:
        if self.agent is not None:
            self.agent.stop_pump()  # no more notifications scheduling releases
        if self._reaper:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
        await self._tasks.wait()
        for lease in self.leases.pop_expired(now=float("inf")):
            await self._free(lease)

    async def _free(self, lease: Lease) -> None:
        rid = lease.request_id
        await self.host.run(lambda e: e.release_pinned(rid))

    async def release(self, lease_id: str = "", request_id: str = "") -> bool:
        lease = self.leases.pop(lease_id=lease_id, request_id=request_id)
        if lease is None:
            return False
        await self._free(lease)
        return True

    def _release_early(self, request_id: str) -> bool:
        """ReleaseKV by request id with no lease to release (yet). Returns whether a Prefill was running."""
        now = time.time()
        if len(self._released_early) >= MAX_EARLY_RELEASES:
            for rid, exp in list(self._released_early.items()):
                if exp <= now:
                    del self._released_early[rid]
            while len(self._released_early) >= MAX_EARLY_RELEASES:  # oldest first (insertion order)
                del self._released_early[next(iter(self._released_early))]
        self._released_early[request_id] = now + self.leases.ttl_s
        if request_id in self._running:
            # stop computing for nobody now; the Prefill call sees the abort and frees what it holds
            self.host.submit(lambda e: e.abort(request_id, "CANCELLED"))
            return True
        return False

    def _was_released(self, request_id: str) -> bool:
        exp = self._released_early.pop(request_id, None)
        return exp is not None and exp > time.time()

    async def Prefill(self, request: worker_pb2.PrefillRequest, context) -> worker_pb2.PrefillResponse:
        rid = request.request_id
        if self._was_released(rid):
            await context.abort(grpc.StatusCode.CANCELLED, "the KV of this request was released before its prefill")
        if rid in self._running:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"duplicate request id {rid!r}")
        self._running.add(rid)
        owned = True  # the engine request under this id is ours to clean up
        handed_over = False  # the pinned KV belongs to a lease now
        try:
            resp = await self._prefill(request, context, rid)
            handed_over = resp.HasField("kv")
            if handed_over:
                self._release_if_undelivered(context, resp.kv.lease_id)
            return resp
        except ValueError as e:  # refused by the engine (a duplicate id there is someone else's)
            owned = False
            await refuse_invalid(context, e)
        except CompileTimeout as e:  # nothing was added to the engine
            owned = False
            await abort_compile_timeout(context, e)
        finally:
            self._running.discard(rid)
            if owned and not handed_over:
                # cancelled (the gateway gave up), released early, failed, or the first token ended it: abort it
                # if it still runs, free its KV if it is pinned for nobody. Queued behind whatever the engine
                # still has to do for it; a synchronous call, so a cancellation cannot cut it short.
                self.host.submit(lambda e: e.discard(rid))

    def _release_if_undelivered(self, context, lease_id: str) -> None:
        """The caller cancelled after the lease was made but before the reply reached it: nobody knows the lease
        id, nobody will pull or release it; release it now rather than at lease expiry."""
        loop = asyncio.get_running_loop()

        def on_done(ctx) -> None:
            if ctx.cancelled():
                loop.call_soon_threadsafe(self._release_soon, lease_id)

        context.add_done_callback(on_done)
        if context.cancelled():  # cancelled before the callback was added: it may never be called
            self._release_soon(lease_id)  # idempotent with the callback's

    async def _prefill(self, request: worker_pb2.PrefillRequest, context, rid: str) -> worker_pb2.PrefillResponse:
        # All branches (n, or best_of): the request forks at its first sample, so each branch samples its own first
        # token here while the prompt's blocks are computed and pinned once; the decode side forks the same
        # branches over one copy of them.
        params = params_from_pb(request.params)
        final = None
        lim = limits_from_pb(request.lifecycle)
        lim.apply_share(self.host, request.namespace)
        async for out in self.host.generate(rid, list(request.prompt_token_ids), params,
                                              namespace=request.namespace, prefill_only=True, deadline=lim.deadline,
                                              priority=lim.priority,
                                              predicted_output_tokens=lim.predicted_output_tokens):
            final = out
        if self._was_released(rid):  # ReleaseKV came while it ran: pin nothing (the finally frees it)
            await context.abort(grpc.StatusCode.CANCELLED, "the KV of this request was released during its prefill")
        M.observe_engine_times(final)
        resp = worker_pb2.PrefillResponse(request_id=rid, num_cached_tokens=final.num_cached_tokens or 0)
        fill_times(resp.times, final.times)  # the gateway combines these with the decode worker's (stage_times)
        if final.state != "FINISHED" or not any(c.finish_reason == "prefill" for c in final.outputs):
            # The first tokens already ended every branch (or it failed): nothing to hand over (Prefill's finally
            # frees what is pinned).
            resp.finished = True
            resp.final.CopyFrom(full_response(final, self.tokenizer))
            if final.state != "FINISHED":
                M.TERMINAL.labels(final.state).inc()
            return resp
        self._first_tokens(resp, final, params, rid)
        self._hand_over(resp, rid)
        return resp

    def _first_tokens(self, resp: worker_pb2.PrefillResponse, final, params, rid: str) -> None:
        """Each branch's first token for the decode side, and (unless best_of > n) the stream's first message."""
        # Every branch goes on to the decode side (the engine shows them all to a hand-off, best_of included).
        enc = DeltaEncoder(self.tokenizer)
        for comp in final.outputs:
            ft = resp.first_tokens.add(token_id=comp.token_ids[0], cumulative_logprob=comp.cumulative_logprob)
            if params.logprobs is not None and comp.logprobs:
                ft.logprob.CopyFrom(enc.token_logprob(comp.logprobs[0]))
        first = resp.first
        first.request_id = rid
        if params.best_of is None or params.best_of == params.n:
            # The first tokens as the stream's first message: the gateway emits them before the KV moves (their
            # text is the engine's, after stop-string hold-back, exactly what the decode side will repeat).
            # best_of > n shows nothing before the end.
            for comp, ft in zip(final.outputs, resp.first_tokens):
                delta = first.outputs.add(index=comp.index, text=comp.text or "", token_ids=[ft.token_id])
                if ft.HasField("logprob"):
                    delta.logprobs.append(ft.logprob)
        if final.prompt_logprobs:  # computed here, over the prompt: the decode side never sees them
            enc.prompt_logprobs(first, final)
        if not first.outputs and not first.prompt_logprobs:
            resp.ClearField("first")

    def _hand_over(self, resp: worker_pb2.PrefillResponse, rid: str) -> None:
        """Lease the pinned KV to the decode side: where it lies (this worker, its blocks) and the lease on it."""
        # Read in this thread, not through an engine-thread round trip (~0.2 ms of TTFT): the engine filed the
        # entry before it delivered this final output, and only a release of the lease made below changes it.
        blocks, ntok = self.pinned_kv(rid)
        lease = self.leases.add(rid, blocks, ntok)
        if self.agent is not None:
            self.agent.wake_pump()
        kv = resp.kv
        kv.worker_id = self.endpoint.worker_id
        kv.worker_address = self.endpoint.address
        kv.incarnation = self.endpoint.incarnation
        kv.block_ids.extend(blocks)
        kv.num_tokens = ntok
        kv.lease_id = lease.lease_id
        kv.lease_expiry_unix = lease.expiry

    async def KvHandshake(self, request: worker_pb2.KvHandshakeRequest, context) -> worker_pb2.KvHandshakeResponse:
        """A decode worker's first hand-off from this process: agree on the protocol, hand out the region."""
        me = self.endpoint
        if request.protocol_version != me.protocol_version:
            M.REJECTIONS.labels("kv_protocol_mismatch").inc()
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"KV protocol version mismatch: local={me.protocol_version} "
                                f"remote={request.protocol_version}")
        try:  # the decode side checks the region's layout in any case; this names the problem on both sides
            if request.HasField("layout"):
                check_compatible(me.layout, KVLayout.from_dict(layout_from_pb(request.layout)))
        except KVLayoutMismatch as e:
            M.REJECTIONS.labels("kv_layout_mismatch").inc()
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        M.KV_HANDSHAKES.labels("served").inc()
        return worker_pb2.KvHandshakeResponse(protocol_version=me.protocol_version, incarnation=me.incarnation,
                                              region=me.region, tp_regions=me.tp_regions)

    async def ReleaseKV(self, request, context):
        ok = await self.release(lease_id=request.lease_id, request_id=request.request_id)
        if not ok and request.request_id and not request.lease_id:
            # no lease: the gateway gave up before a Prefill reply named one (its client left early)
            ok = self._release_early(request.request_id)
        return worker_pb2.ReleaseKVResponse(released=ok)
