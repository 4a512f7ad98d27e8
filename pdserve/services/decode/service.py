"""Decode side: allocate blocks, pull the prompt's KV with one batched NIXL READ, release the prefill side,
commit, then stream tokens (the first message carries the first token sampled by the prefill worker).

A failed or timed-out pull ends the request FAILED (engine.fail_prefilled reclaims the local blocks), the
prefill side is told to release, and the worker stays healthy.

Cancellation (the gateway's client left) can strike at any await of the hand-off: while the allocation is queued
on the engine thread, during the READ, before the commit, mid-stream. Every exit goes through one synchronous
cleanup (`_cleanup`, in `finally`, awaiting nothing, so a cancellation cannot cut it short): the prefill side is
told to release (once), and the local request is aborted behind the allocation (engine commands run in order, so
an abort queued after an allocation that is still queued undoes it) - after the READ has stopped writing into
its blocks. The engine's transfer deadline (`Engine.expire_transfers`) is the backstop if a pickup is ever left
neither committed nor failed.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from pdserve import env_knobs
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.grammar_pool import CompileTimeout
from pdserve.kv_transfer.agent import KVAgent, KVTransferError, TransferFailure
from pdserve.kv_transfer.layout import KVLayoutMismatch
from pdserve.kv_transfer.probe import probe_link
from pdserve.kv_transfer.tp_pull import KvPuller
from pdserve.kv_transfer.ucx_log import UcxLog
from pdserve.kv_transfer.ucx_proto_info import observed
from pdserve.services.convert import DeltaEncoder, first_tokens_from_pb, limits_from_pb, params_from_pb
from pdserve.services.decode.pair_metrics import MAX_PEERS, PairMetrics
from pdserve.services.decode.peers import KvPeers
from pdserve.services.decode.pull_plan import pull_plan
from pdserve.services.grpc_util import abort_compile_timeout, channel
from pdserve.services.kv_endpoint import KvEndpoint
from pdserve.services.load_meter import LoadMeter
from pdserve.services.metrics import worker as M
from pdserve.services.pb import common_pb2, worker_pb2, worker_pb2_grpc
from pdserve.services.refusal import refuse_invalid
from pdserve.services.tasks import OwnedTasks

log = logging.getLogger("pdserve.decode")


# Fault injection only (tests/e2e/test_migration.py): a pause before each pull, a window in which a test kills the
# prefill worker holding the KV.
FAULT_PULL_DELAY_S = float(env_knobs.get("PDSERVE_FAULT_PULL_DELAY_S") or 0)

# The engine's backstop for a pickup left neither committed nor failed: this long past the READ's own timeout
# (the allocation and commit are engine commands, queued behind at most a step or two).
TRANSFER_GRACE_S = 5.0

# Threads for the READs and link self-tests, this side's own. A READ holds its thread until DONE, ERR or its
# timeout, so a peer that stopped answering holds one per pickup for up to the transfer timeout. In asyncio's
# default pool (min(32, cores + 4): 6 on 2 vCPUs) a few such READs starved everything else queued there, the
# heartbeat's UCX log poll included: both decode workers left the registry under an asymmetric partition.
PULL_THREADS = 64


@dataclass
class _Pickup:
    """What one GenerateFromPrefill call holds, so that its cleanup undoes exactly that."""

    added: bool = False  # an add_prefilled_request is queued or done: the engine may hold blocks for it
    xfer: asyncio.Future | None = None  # the NIXL READ into those blocks
    attached: bool = False  # an output queue is registered under the request id
    released: bool = False  # the prefill side was told to release its copy
    ended: bool = False  # a terminal message went out or the call was refused: nothing left to cancel


@dataclass
class _Pulled:
    """A pickup's READ: when it ran, what it moved, how it failed (None: it did not)."""
    t0: float
    t1: float = 0.0
    nbytes: int = 0
    failure: KVTransferError | None = None


class DecodeSide:
    def __init__(self, host: AsyncEngine, endpoint: KvEndpoint, agent: KVAgent | None, tokenizer,
                 meter: LoadMeter | None, transfer_timeout_s: float, alloc_wait_s: float = 10.0, rank_agents=None,
                 ucx: UcxLog | None = None):
        """`rank_agents` (kv_transfer/tp_ranks.RankAgents): this worker's other TP ranks, each pulling its heads.
        `ucx`: this process's UCX log, where UCX says which transport it chose for each peer (kv_transfer/ucx_log.py)."""
        self.host = host
        self.agent = agent
        self.puller = KvPuller(agent, rank_agents) if agent is not None else None
        self.layout = endpoint.layout
        self.tokenizer = tokenizer
        self.meter = meter  # the router's link bandwidth and hand-off cost are measured here
        self.transfer_timeout_s = transfer_timeout_s
        self.alloc_wait_s = alloc_wait_s
        self._channels: dict[str, grpc.aio.Channel] = {}
        # every task this side starts (ReleaseKV calls, aborts waiting for a READ, the READs themselves): owned,
        # so none is collected mid-flight, and close() waits for them, then cancels what is left
        self._tasks = OwnedTasks()
        self.pairs = PairMetrics()  # per prefill peer: bytes, seconds, failures, expired leases, self-test
        self._probed: set[tuple[str, str]] = set()  # peer incarnations whose link was self-tested
        self.ucx = ucx
        self._marks: dict[tuple[str, str], int] = {}  # peer incarnation -> UCX's report before its first READ
        self.observed: dict[str, str] = {}  # prefill peer id -> the transport UCX chose for its READs
        self.peers = KvPeers(self._stub, endpoint.layout, endpoint.protocol_version,
                             self.puller.forget_remote if agent is not None else (lambda name: None))
        self._pool = ThreadPoolExecutor(PULL_THREADS, thread_name_prefix="pdserve-kv-pull")

    async def _in_pool(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _read_by(self, deadline: float, regions, src: list[int], dst: list[int], notif: bytes) -> int:
        """The READ with what is left of its time when a pool thread takes it: one that waited for a thread must
        not read past its lease (the prefill side may have reused the blocks)."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise KVTransferError("KV transfer waited for a pull thread past its deadline", TransferFailure.TIMEOUT)
        return self.puller.read(regions, src, dst, notif, left)

    def _mark_once(self, kv: common_pb2.KvHandle) -> None:
        """Before the first READ from a peer incarnation: where UCX's report stands. What UCX reports from here
        to the end of that READ is its selection for this peer (kv_transfer/ucx_log.py)."""
        key = (kv.worker_address, kv.incarnation)
        if self.ucx is not None and self.ucx.active and key not in self._marks and key not in self._probed:
            self._marks[key] = self.ucx.mark()

    def _probe_once(self, kv: common_pb2.KvHandle, regions) -> None:
        """After the first pull from a peer incarnation: the transport UCX chose for it (kv_transfer/
        ucx_proto_info.py), then the transport self-test (kv_transfer/probe.py) in the background: its bandwidth
        feeds the router's transfer cost, its figures the per-pair gauges. The self-test is for single-pool pairs
        only (a TP pull's ranks read their own slices)."""
        key = (kv.worker_address, kv.incarnation)
        if key in self._probed or self.agent is None:
            return
        self._probed.add(key)
        self._observe(kv.worker_id, self._marks.pop(key, None))
        if self.puller.ranks is None and len(regions) == 1:
            self._tasks.spawn(self._probe(kv.worker_id, regions[0]))

    def _observe(self, peer: str, mark: int | None) -> None:
        """What UCX reported since the peer's mark, read once per peer incarnation (a flush and a read of a few
        hundred bytes). No mark (UCX's log is not this worker's to read): the peer is `unknown`."""
        new, known = (self.ucx.since(mark), self.ucx.since(0)) if mark is not None else ([], [])
        got = observed(self.agent.name, new, known)
        if peer in self.observed or len(self.observed) < MAX_PEERS:  # the registry record stays small
            self.observed[peer] = got
        self.pairs.transport(peer, got)
        log.info("KV from %s: UCX chose %s for its READs", peer, got)

    async def _probe(self, peer: str, region) -> None:
        try:
            got = await self._in_pool(probe_link, self.agent, region, min(5.0, self.transfer_timeout_s))
        except Exception as e:  # as a pull's READ: NIXL's own exception classes are not RuntimeErrors
            # (registering the staging buffer can raise them too); a failed self-test is a warning, not a crash
            log.warning("KV link self-test with %s failed: %s", peer, e)
            return
        self.pairs.probed(peer, got.latency_s, got.bytes_per_s)
        if self.meter is not None:
            self.meter.observe_probe(got.bytes_per_s)
        log.info("KV link self-test with %s: %.1f Mbit/s over %d bytes, READ latency %.2f ms", peer,
                 got.bytes_per_s * 8 / 1e6, got.nbytes, got.latency_s * 1e3)

    def _stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = channel(address)
        return worker_pb2_grpc.WorkerStub(ch)

    async def close(self, grace_s: float = 10.0) -> None:
        """Let outstanding cleanups (ReleaseKV calls, aborts waiting for a READ) finish for `grace_s` (a READ
        ends by its own timeout), then cancel what is left and wait for it."""
        await self.peers.close()
        await self._tasks.wait(grace_s)
        await self._tasks.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)  # a READ still running ends by its own timeout

    async def _release_remote(self, kv: common_pb2.KvHandle, request_id: str) -> None:
        try:
            await self._stub(kv.worker_address).ReleaseKV(
                worker_pb2.ReleaseKVRequest(request_id=request_id, lease_id=kv.lease_id), timeout=5)
        except grpc.aio.AioRpcError as e:  # the lease reaper on the prefill side is the backstop
            log.warning("ReleaseKV %s on %s failed: %s", request_id, kv.worker_address, e.code())

    def _release_once(self, p: _Pickup, kv: common_pb2.KvHandle, rid: str) -> None:
        if not p.released:
            p.released = True
            self._tasks.spawn(self._release_remote(kv, rid))

    async def _abort_after(self, xfer: asyncio.Future, rid: str) -> None:
        # never free blocks NIXL may still be writing into: the READ ends by its own timeout at the latest
        await asyncio.wait({xfer})
        if not xfer.cancelled():
            xfer.exception()  # retrieved: a failed READ of a cancelled pickup is no news
        self.host.submit(lambda e: e.abort(rid, "CANCELLED"))

    def _cleanup(self, p: _Pickup, kv: common_pb2.KvHandle, rid: str) -> None:
        """Every exit of GenerateFromPrefill. Awaits nothing, so a cancellation cannot cut it short; idempotent
        pieces only (ReleaseKV and abort are no-ops the second time)."""
        self._release_once(p, kv, rid)
        if not p.ended:  # the caller went away (disconnect / cancel) or something broke
            M.TERMINAL.labels("CANCELLED").inc()
            if p.added:
                if p.xfer is not None and not p.xfer.done():
                    self._tasks.spawn(self._abort_after(p.xfer, rid))
                else:  # queued behind the allocation if that is still queued: it undoes it
                    self.host.submit(lambda e: e.abort(rid, "CANCELLED"))
        if p.attached:  # attached before a commit whose output we may never have read
            self.host.detach(rid)

    async def GenerateFromPrefill(self, request: worker_pb2.GenerateFromPrefillRequest, context):
        p = _Pickup()
        try:
            async with contextlib.aclosing(self._pickup(request, context, p)) as msgs:
                async for msg in msgs:
                    yield msg
        finally:
            self._cleanup(p, request.kv, request.request_id)

    async def _pickup(self, request: worker_pb2.GenerateFromPrefillRequest, context, p: _Pickup):
        """Allocate, pull, commit, stream. A refusal aborts the call; a failure of the prefill side (its peer,
        the KV transfer) is a retryable FAILED message: the gateway places the request again, re-prefilled."""
        host, rid, kv = self.host, request.request_id, request.kv
        # every branch continues here, forked over one copy of the prompt's KV, each from its own first token
        params = params_from_pb(request.params)
        firsts = first_tokens_from_pb(request.first_tokens)
        if FAULT_PULL_DELAY_S:
            await asyncio.sleep(FAULT_PULL_DELAY_S)
        self._mark_once(kv)
        regions = await self._peer_regions(kv, context, p, rid)
        if isinstance(regions, common_pb2.GenerateResponse):
            yield regions
            return
        prompt = list(request.prompt_token_ids)
        t_start = time.time()
        lim = limits_from_pb(request.lifecycle)
        lim.apply_share(host, request.namespace)
        grammar = await self._grammar(params, lim.deadline, context, p)
        budget = self.transfer_timeout_s + TRANSFER_GRACE_S

        def add(e):
            return e.add_prefilled_request(rid, prompt, firsts, params, namespace=request.namespace,
                                           transfer_deadline=time.time() + budget, deadline=lim.deadline,
                                           priority=lim.priority, grammar=grammar)

        dst_blocks, cached = await self._allocate(add, context, p)  # 1. allocate
        pulled = await self._pull(kv, regions, dst_blocks, cached, p)  # 2. pull what the prefix cache lacks
        if pulled.failure is not None:
            yield self._pull_failed(pulled.failure, kv, rid, p)
            return
        # 3. commit: the request joins the decode batch; its first output carries the first token
        stream = host.attach(rid)  # before the commit, so the first output (the first token) is not missed
        p.attached = True
        if not await host.run(lambda e: e.commit_prefilled(rid)):
            # the engine already gave the blocks back (transfer deadline): the KV that arrived has nowhere to go
            M.TERMINAL.labels("FAILED").inc()
            p.ended = True
            yield common_pb2.GenerateResponse(request_id=rid, finished=True, state="FAILED",
                                              error="KV transfer completed after its deadline")
            return
        if self.meter is not None:
            self.meter.observe_transfer(pulled.nbytes, pulled.t1 - pulled.t0, time.time() - t_start)
        self._probe_once(kv, regions)  # after its pull: the self-test does not share the link with it
        async with contextlib.aclosing(stream):  # 4. stream
            enc = DeltaEncoder(self.tokenizer)
            first = True
            async for out in stream:
                msg = enc.encode(out)
                if first:
                    msg.times.kv_transfer_start, msg.times.kv_transfer_end = pulled.t0, pulled.t1
                    msg.times.kv_bytes = pulled.nbytes
                    first = False
                if out.finished:
                    p.ended = True
                    M.TERMINAL.labels(out.state).inc()
                yield msg
                # the prefill side may free its copy now (the READ's notification says the same); sent after the
                # first token went out, as starting the ReleaseKV call first delays it
                self._release_once(p, kv, rid)

    async def _peer_regions(self, kv: common_pb2.KvHandle, context, p: _Pickup, rid: str):
        """Where the peer's blocks live (a handshake with the first hand-off from each peer incarnation); or the
        retryable FAILED message when the peer cannot be reached. An incompatible peer aborts the call."""
        try:
            return await self.peers.region(kv.worker_address, kv.incarnation)
        except KVLayoutMismatch as e:
            M.REJECTIONS.labels("kv_layout_mismatch").inc()
            p.ended = True
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except KVTransferError as e:
            M.KV_TRANSFER_FAILURES.labels(e.kind.value).inc()
            self.pairs.failed(kv.worker_id, e.kind)
            p.ended = True
            if e.kind is TransferFailure.INCOMPATIBLE:  # the gateway fails it like a broken prefill peer
                M.REJECTIONS.labels("kv_incompatible_peer").inc()
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
            self._release_once(p, kv, rid)
            M.TERMINAL.labels("FAILED").inc()
            log.warning("request %s: %s", rid, e)
            return common_pb2.GenerateResponse(request_id=rid, finished=True, state="FAILED",
                                               error=f"KV transfer failed: {e}", retryable=True)

    async def _grammar(self, params, deadline: float | None, context, p: _Pickup):
        """The constraint, compiled off the engine thread before anything is allocated (None: unconstrained)."""
        try:
            return await self.host.compile_grammar(params, deadline)
        except ValueError as e:
            p.ended = True
            await refuse_invalid(context, e)
        except CompileTimeout as e:
            p.ended = True
            await abort_compile_timeout(context, e)

    async def _allocate(self, add, context, p: _Pickup) -> tuple[list[int], int]:
        """The request's decode blocks and how many its local prefix cache already holds, waiting up to
        `alloc_wait_s` for capacity (decode blocks free up as other requests finish)."""
        deadline = time.monotonic() + self.alloc_wait_s
        while True:
            p.added = True  # queued from here on: it runs even if this call is cancelled while awaiting it
            try:
                alloc = await self.host.run(add)
            except ValueError as e:
                p.added, p.ended = False, True  # refused: nothing of ours (a duplicate id is someone else's)
                await refuse_invalid(context, e)
            if alloc is not None:
                return alloc
            p.added = False  # None: nothing was allocated or registered
            if time.monotonic() > deadline:
                M.REJECTIONS.labels("decode_kv_full").inc()
                p.ended = True
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no KV capacity on the decode worker")
            await asyncio.sleep(0.02)

    async def _pull(self, kv: common_pb2.KvHandle, regions, dst_blocks: list[int], cached: int,
                    p: _Pickup) -> _Pulled:
        """ONE batched READ per pair of pools of the blocks the local prefix cache does not hold (pull_plan.py;
        each local TP rank reads its heads from the peer's ranks that hold them: kv_transfer/tp_pull.py)."""
        out = _Pulled(t0=time.time())
        try:
            plan = pull_plan(list(kv.block_ids), dst_blocks, cached, kv.num_tokens, self.layout.block_size)
        except ValueError as e:  # a handle that does not cover its own tokens: nothing to read from
            out.failure, out.t1 = KVTransferError(str(e), TransferFailure.INCOMPATIBLE), time.time()
            return out
        src, dst = plan.src, plan.dst
        # The READ must give up before the prefill side's lease can free the source blocks (a READ racing the
        # reaper would copy blocks that may already hold another request's KV).
        timeout = self.transfer_timeout_s
        if kv.lease_expiry_unix:
            timeout = min(timeout, kv.lease_expiry_unix - time.time() - 0.5)
        if timeout <= 0:
            out.failure = KVTransferError("KV lease expired before the transfer started",
                                          TransferFailure.LEASE_EXPIRED)
            self.pairs.failed(kv.worker_id, out.failure.kind)
        elif src:
            p.xfer = self._tasks.spawn(self._in_pool(
                self._read_by, time.monotonic() + timeout, regions, src, dst, kv.lease_id.encode()))
            try:
                out.nbytes = await asyncio.shield(p.xfer)  # a cancel here leaves the READ to _cleanup
                M.KV_TRANSFER_BYTES.inc(out.nbytes)
                self.pairs.pulled(kv.worker_id, out.nbytes, time.time() - out.t0)
                M.KV_PULL_BLOCKS.inc(len(src))
                M.KV_PULL_REUSED_BLOCKS.inc(plan.reused)
            except KVTransferError as e:
                out.failure = e
            except Exception as e:  # a layout mismatch, NIXL's own exception classes (not RuntimeErrors): typed
                out.failure = KVTransferError(f"{type(e).__name__}: {e}", TransferFailure.NIXL_ERROR)
            if out.failure is not None:
                self.pairs.failed(kv.worker_id, out.failure.kind)
                for r in regions:  # a dead peer must be re-added if it comes back
                    self.puller.forget_remote(r.agent_name)
        out.t1 = time.time()
        M.KV_TRANSFER_SECONDS.observe(out.t1 - out.t0)
        return out

    def _pull_failed(self, failure: KVTransferError, kv: common_pb2.KvHandle, rid: str,
                     p: _Pickup) -> common_pb2.GenerateResponse:
        """A failed READ: the prefill side's copy goes, the engine's blocks too; retryable for the gateway."""
        err = f"KV transfer failed: {failure}"
        self._release_once(p, kv, rid)
        M.KV_TRANSFER_FAILURES.labels(failure.kind.value).inc()
        self.host.submit(lambda e: e.fail_prefilled(rid))
        M.TERMINAL.labels("FAILED").inc()
        p.ended = True
        log.warning("request %s: %s", rid, err)
        return common_pb2.GenerateResponse(request_id=rid, finished=True, state="FAILED", error=err, retryable=True)
