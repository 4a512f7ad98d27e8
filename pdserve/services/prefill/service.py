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
import grpc

from pdserve.kv_transfer.lease import Lease, LeaseTable, reap_forever
from pdserve.services.metrics import worker as M
from pdserve.services.admission import lifecycle_from_context
from pdserve.services.convert import DeltaEncoder, fill_times, full_response
from pdserve.services.grpc_util import param_metadata
from pdserve.services.pb import params_from_pb, worker_pb2

log = logging.getLogger("pdserve.prefill")

# Early releases remembered at most (a client could send ReleaseKV for ids that never come)
MAX_EARLY_RELEASES = 10_000


class PrefillSide:
    def __init__(self, worker, lease_ttl_s: float):
        self.w = worker
        self.leases = LeaseTable(ttl_s=lease_ttl_s)
        self._reaper: asyncio.Task | None = None
        self._running: set[str] = set()  # request ids whose Prefill call is in progress
        # request id -> expiry (time.time()): ReleaseKV came before the Prefill could pin anything
        self._released_early: dict[str, float] = {}
        self._tasks: set[asyncio.Task] = set()  # releases for replies that never reached the caller

    async def start(self) -> None:
        loop = asyncio.get_running_loop()

        def on_notif(msg: bytes) -> None:  # NIXL pump thread: the decode side finished its READ
            asyncio.run_coroutine_threadsafe(self.release(lease_id=msg.decode(errors="replace")), loop)

        if self.w.agent is not None:
            # fast polling only while leases are out: an idle pump would slow this worker's prefill forwards
            self.w.agent.start_pump(on_notif, active=lambda: len(self.leases) > 0)
        self._reaper = asyncio.create_task(reap_forever(self.leases, self._free, interval_s=0.25,
                                                        on_reaped=lambda l: M.LEASES_EXPIRED.inc()))

    async def stop(self) -> None:
        if self._reaper:
            self._reaper.cancel()
        await asyncio.gather(*list(self._tasks), return_exceptions=True)
        for lease in self.leases.pop_expired(now=float("inf")):
            await self._free(lease)

    async def _free(self, lease: Lease) -> None:
        rid = lease.request_id
        await self.w.host.run(lambda e: e.release_pinned(rid))

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
            self.w.host.submit(lambda e: e.abort(request_id, "CANCELLED"))
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
            M.REJECTIONS.labels("invalid_request").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e), trailing_metadata=param_metadata(e))
        finally:
            self._running.discard(rid)
            if owned and not handed_over:
                # cancelled (the gateway gave up), released early, failed, or the first token ended it: abort it
                # if it still runs, free its KV if it is pinned for nobody. Queued behind whatever the engine
                # still has to do for it; a synchronous call, so a cancellation cannot cut it short.
                self.w.host.submit(lambda e: e.discard(rid))

    def _release_if_undelivered(self, context, lease_id: str) -> None:
        """The caller cancelled after the lease was made but before the reply reached it: nobody knows the lease
        id, nobody will pull or release it; release it now rather than at lease expiry."""
        loop = asyncio.get_running_loop()

        def release() -> None:
            t = asyncio.ensure_future(self.release(lease_id=lease_id))
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

        def on_done(ctx) -> None:
            if ctx.cancelled():
                loop.call_soon_threadsafe(release)

        context.add_done_callback(on_done)
        if context.cancelled():  # cancelled before the callback was added: it may never be called
            release()  # idempotent with the callback's

    async def _prefill(self, request: worker_pb2.PrefillRequest, context, rid: str) -> worker_pb2.PrefillResponse:
        # All branches (n, or best_of): the request forks at its first sample, so each branch samples its own first
        # token here while the prompt's blocks are computed and pinned once; the decode side forks the same
        # branches over one copy of them.
        params = params_from_pb(request.params)
        final = None
        lc = lifecycle_from_context(context)
        async for out in self.w.host.generate(rid, list(request.prompt_token_ids), params,
                                              namespace=request.namespace, prefill_only=True, **lc):
            final = out
        if self._was_released(rid):  # ReleaseKV came while it ran: pin nothing (the finally frees it)
            await context.abort(grpc.StatusCode.CANCELLED, "the KV of this request was released during its prefill")
        self.w.observe_engine_times(final)
        resp = worker_pb2.PrefillResponse(request_id=rid, num_cached_tokens=final.num_cached_tokens or 0)
        fill_times(resp.times, final.metrics)  # the gateway combines these with the decode worker's (stage_times)
        if final.state != "FINISHED" or not any(c.finish_reason == "prefill" for c in final.outputs):
            # The first tokens already ended every branch (or it failed): nothing to hand over (Prefill's finally
            # frees what is pinned).
            resp.finished = True
            resp.final.CopyFrom(full_response(final, self.w.tokenizer))
            if final.state != "FINISHED":
                M.TERMINAL.labels(final.state).inc()
            return resp
        # Every branch goes on to the decode side (the engine shows them all to a hand-off, best_of included).
        enc = DeltaEncoder(self.w.tokenizer)
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
        # Read in this thread, not through an engine-thread round trip (~0.2 ms of TTFT): the engine filed the
        # entry before it delivered this final output, and only a release of the lease made below changes it.
        blocks, ntok = self.w.engine.pinned_kv(rid)
        lease = self.leases.add(rid, blocks, ntok)
        if self.w.agent is not None:
            self.w.agent.wake_pump()
        kv = resp.kv
        kv.worker_id = self.w.worker_id
        kv.worker_address = self.w.address
        kv.region.CopyFrom(self.w.region_pb)
        kv.block_ids.extend(blocks)
        kv.num_tokens = ntok
        kv.lease_id = lease.lease_id
        kv.lease_expiry_unix = lease.expiry
        return resp

    async def ReleaseKV(self, request, context):
        ok = await self.release(lease_id=request.lease_id, request_id=request.request_id)
        if not ok and request.request_id and not request.lease_id:
            # no lease: the gateway gave up before a Prefill reply named one (its client left early)
            ok = self._release_early(request.request_id)
        return worker_pb2.ReleaseKVResponse(released=ok)
