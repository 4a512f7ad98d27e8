"""Gateway request path: route, then either one Generate stream on a `both` worker (colocated) or
Prefill on a prefill worker + GenerateFromPrefill on a decode worker (disaggregated).

Everything yields `GenerateResponse` deltas; the HTTP and gRPC front doors format them. Cancelling the
consumer cancels the in-flight gRPC calls, which aborts the request on every worker holding it.

Prefill-side KV: once a prefill worker has pinned a prompt's KV under a lease, only the decode worker's pull, a
ReleaseKV or the lease's expiry frees it. A disaggregated request that ends any other way than with the decode
stream's last message (client gone, decode refused or broken, cancelled while the Prefill call was in flight
and its answer lost) sends ReleaseKV by request id; the worker side is idempotent. The RPC runs in a task the
Dispatcher owns, because the code path that notices is usually being cancelled itself.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

import grpc

from pdserve.engine.sampling_params import SamplingParams
from pdserve.services.convert import params_to_pb
from pdserve.services.gateway.migration import (
    HANDOFF,
    KV_TRANSFER,
    STALL_CHECK_S,
    UNAVAILABLE,
    Broken,
    Sent,
    break_reason,
    broken_by,
    watched,
)
from pdserve.services.gateway.stages import StageTrace
from pdserve.services.gateway.suspects import Suspects
from pdserve.services.grpc_util import channel, param_of
from pdserve.services.metrics import gateway as M
from pdserve.services.pb import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from pdserve.services.role_switch import is_refusal
from pdserve.services.tasks import OwnedTasks

log = logging.getLogger("pdserve.gateway")


RELAY_QUEUE_PER_SUB = 4  # messages a fanned-out request may hold at the gateway per sub-request


class NoWorkersError(Exception):
    pass


class UpstreamError(Exception):
    """A worker refused the request (INVALID_ARGUMENT -> 400, layout mismatch -> 500, ...). `param`: the request
    parameter an INVALID_ARGUMENT named (the worker's `pdserve-param` trailing metadata)."""

    def __init__(self, code: grpc.StatusCode, details: str, param: str | None = None):
        super().__init__(details)
        self.code, self.details, self.param = code, details, param


@dataclass
class SubRequest:
    """One engine request: one prompt with all its n (best_of) branches, on one worker."""
    prompt_token_ids: list[int]
    params: SamplingParams
    index_base: int  # where this sub-request's choices go in the response (its branch i is choice base + i)

    @property
    def n_choices(self) -> int:
        return self.params.n


@dataclass
class _Attempt:
    """One placement as its retry loop sees it: the worker whose RPC error would be the placement's, and whether
    any message reached the client (then only migration, or the end, follows)."""
    worker_id: str
    emitted: bool = False


class Dispatcher:
    def __init__(self, router_address: str, model: str, max_attempts: int = 3, migration_limit: int = 2,
                 require_disagg: bool = False):
        self.model = model
        self.max_attempts = max_attempts
        self.migration_limit = migration_limit  # moves per sub-request after a worker died (migration.py)
        self.require_disagg = require_disagg  # a fresh placement on one worker is refused (gateway/path.py)
        self._listed_ids: set[str] | None = None  # the router's last worker list (None: unknown)
        self._listed_at = float("-inf")
        # active-active routers (`--router a,b`): calls go to the last one that answered; one that cannot be
        # reached, or hangs, is replaced by the next within the same call
        self._routers = [router_pb2_grpc.RouterStub(channel(a.strip())) for a in router_address.split(",")
                         if a.strip()]
        self._primary = 0
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._tasks = OwnedTasks()  # ReleaseKV calls that outlive their request
        self.suspects = Suspects()  # workers a call just found dead: skipped until the registry drops them

    async def close(self, timeout_s: float = 5.0) -> None:
        """Shutdown: let in-flight ReleaseKV calls complete."""
        await self._tasks.wait(timeout_s)

    def stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = channel(address, relay=True)
        return worker_pb2_grpc.WorkerStub(ch)

    async def _ask(self, method: str, request, timeout: float = 5.0):
        """One router RPC, failing over: UNAVAILABLE (down, or its own "no placement", which the next one then
        repeats) or DEADLINE_EXCEEDED (hung) moves on to the next router; the last error is raised."""
        err, first = None, self._primary  # read once: concurrent calls move it while this one waits
        for k in range(len(self._routers)):
            i = (first + k) % len(self._routers)
            try:
                reply = await getattr(self._routers[i], method)(request, timeout=timeout)
            except grpc.aio.AioRpcError as e:
                if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                err = e
                continue
            self._primary = i
            return reply
        raise err

    async def list_workers(self) -> router_pb2.ListWorkersResponse:
        return await self._ask("ListWorkers", router_pb2.ListWorkersRequest(model=self.model))

    async def route(self, rid: str, n_prompt: int, namespace: str, exclude: list[str],
                    prompt: list[int] | None = None, max_tokens: int = 0, prefer: str = "") -> router_pb2.RouteResponse:
        wide = self.suspects.with_(exclude)
        for excluded in ([wide, exclude] if len(wide) > len(exclude) else [exclude]):
            try:
                # the token ids let the router look the prompt's prefix up in its index (docs/routing.md)
                return await self._ask("Route", router_pb2.RouteRequest(
                    request_id=rid, num_prompt_tokens=n_prompt, namespace=namespace, model=self.model,
                    exclude_worker_ids=excluded, prompt_token_ids=prompt or [], max_tokens=max_tokens or 0,
                    prefer=prefer))
            except grpc.aio.AioRpcError as e:
                err = e
                if e.code() != grpc.StatusCode.UNAVAILABLE:  # a router that hangs is not asked twice
                    break
        # the suspects left nothing (suspects.py): asked again without them above; this is the router's own answer
        raise NoWorkersError(err.details() or str(err.code())) from None

    async def generate(self, rid: str, sub: SubRequest, namespace: str = "", on_route=None,
                       trace: StageTrace | None = None, lifecycle: common_pb2.Lifecycle | None = None,
                       first_route: router_pb2.RouteResponse | None = None
                       ) -> AsyncIterator[common_pb2.GenerateResponse]:
        """One engine request, all its branches on one worker (or one prefill + one decode worker). Retries
        placement while nothing was emitted and the failure was a worker being unreachable; after tokens went
        out, a worker that dies (or whose prefill peer died) is replaced by migration (migration.py), up to
        `migration_limit` times. `trace` collects the route time, the workers' stage timestamps
        (usage.stage_times) and the migrations. `lifecycle` (deadline, priority, predicted output) goes to every
        worker in its request message. `first_route`: the placement admission was sized by (its prefix-cache
        hit), tried first instead of asking the router again."""
        trace = trace if trace is not None else StageTrace()
        sent = Sent()
        exclude: list[str] = []
        resume: list[int] | None = None  # None: a fresh placement
        handoffs = 0  # moves a role switch asked for: planned, not failures, so outside the limit
        while True:
            try:
                first, first_route = first_route, None
                async for m in self._place(rid, sub, namespace, on_route, trace, lifecycle, exclude, resume, first):
                    sent.add(m)
                    yield m
                return
            except Broken as b:
                exclude.append(b.worker_id)
                if b.reason in (UNAVAILABLE, KV_TRANSFER):  # its process is gone (or its KV source's)
                    self.suspects.add(b.worker_id)
                limited = b.reason != HANDOFF and trace.migrations - handoffs >= self.migration_limit
                if limited or not sent.resumable(sub.params.num_branches):
                    why = "migration limit reached" if sent.resumable(sub.params.num_branches) \
                        else "several branches cannot migrate"
                    yield common_pb2.GenerateResponse(request_id=rid, finished=True, state="FAILED",
                                                      error=f"{b.detail} ({why})")
                    return
                trace.migrations += 1
                handoffs += b.reason == HANDOFF
                M.MIGRATIONS.labels(b.reason).inc()
                resume = list(sent.token_ids.get(0, [])) if sent.any else None
                log.warning("request %s: %s; migrating (%d of at most %d) with %d tokens sent", rid, b.detail,
                            trace.migrations, self.migration_limit, len(resume or ()))

    async def _listed(self, worker_id: str) -> bool:
        """Whether the router still lists the worker (a router that does not answer: assume so). One ListWorkers
        per half stall check serves every silent stream: a queue of thousands does not ask a thousand times."""
        now = time.monotonic()
        if now - self._listed_at > STALL_CHECK_S / 2:
            self._listed_at = now  # before the await: concurrent callers use the last answer meanwhile
            try:
                self._listed_ids = {w.worker_id for w in (await self.list_workers()).workers}
            except grpc.aio.AioRpcError:
                self._listed_ids = None
        return self._listed_ids is None or worker_id in self._listed_ids

    async def _place(self, rid: str, sub: SubRequest, namespace: str, on_route, trace: StageTrace,
                     lifecycle, exclude: list[str], resume: list[int] | None,
                     first: router_pb2.RouteResponse | None = None) -> AsyncIterator[common_pb2.GenerateResponse]:
        """One placement of the sub-request (several while nothing was emitted and workers were unreachable).
        `resume`: the tokens a migrated request's client has; it then runs on one worker that prefills prompt + them
        (a `both` worker, or a decode worker prefilling locally). Raises Broken where a worker failed it after
        tokens went out."""
        pp = params_to_pb(sub.params)
        prompt = sub.prompt_token_ids + (resume or [])
        max_tokens = max(0, (sub.params.max_tokens or 0) - len(resume or ())) if sub.params.max_tokens else 0
        for attempt in range(self.max_attempts):
            # beam search runs whole on one `both` worker (engine/beam.py; none: the prefill worker says 400); a
            # migrated request on one worker that prefills prompt + the tokens sent (a `both` or a decode worker)
            route = first if attempt == 0 and first is not None and resume is None else \
                await self.route(rid, len(prompt), namespace, exclude, prompt, max_tokens,
                                 prefer="colocated" if sub.params.beam else "local" if resume is not None else "")
            if resume is None:
                trace.on_route(route.mode)
            if on_route is not None:
                on_route(route)  # e.g. the latency histograms' mode label, the x-pdserve-route debug header
            colocated = route.mode == "colocated"
            if colocated and resume is None and self.require_disagg:
                from pdserve.services.gateway.path import DisaggUnavailable
                raise DisaggUnavailable(route.reason)
            at = _Attempt(route.both.worker_id if colocated else route.prefill.worker_id)
            if not colocated and resume is not None:
                raise NoWorkersError("no worker can take the migrated request")
            path = self._colocated(rid, sub, pp, namespace, route.both, trace, lifecycle, resume, at) if colocated \
                else self._disaggregated(rid, sub, pp, namespace, route, trace, lifecycle, at)
            try:
                async with contextlib.aclosing(path):  # closing this generator closes the path's (its cleanup)
                    async for m in path:
                        yield m
                return
            except grpc.aio.AioRpcError as e:
                final = self._after_rpc_error(rid, e, at, last=attempt == self.max_attempts - 1)
                if final is not None:
                    yield final
                    return
                exclude.append(at.worker_id)

    def _after_rpc_error(self, rid: str, e: grpc.aio.AioRpcError, at: _Attempt,
                         last: bool) -> common_pb2.GenerateResponse | None:
        """What a worker's RPC error means for the placement: raises Broken (the worker died after tokens went
        out: migrate) or UpstreamError (a refusal before any); returns the FAILED message that ends the stream;
        or None: place it again elsewhere (the worker was unreachable, nothing was emitted)."""
        retryable = e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
        failed = at.worker_id
        if at.emitted and broken_by(e):  # the worker died mid-stream, or handed the stream on: migrate
            raise Broken(failed, break_reason(e), f"worker {failed} failed: {e.code().name}: {e.details()}") from None
        if at.emitted or not retryable or last:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT or not at.emitted and not retryable:
                raise UpstreamError(e.code(), e.details() or "", param_of(e)) from None
            # the stream broke after tokens went out, not by the worker's death: the request ends FAILED (the
            # client already has a partial output, spec §1.7)
            return common_pb2.GenerateResponse(request_id=rid, finished=True, state="FAILED",
                                               error=f"worker {failed} failed: {e.code().name}: {e.details()}")
        log.warning("request %s: worker %s unavailable (%s), rerouting", rid, failed, e.code().name)
        if e.code() == grpc.StatusCode.UNAVAILABLE and not is_refusal(e.details()):  # a switching worker lives
            self.suspects.add(failed)
        return None

    async def _colocated(self, rid: str, sub: SubRequest, pp, namespace: str, both, trace: StageTrace, lifecycle,
                         resume: list[int] | None, at: _Attempt) -> AsyncIterator[common_pb2.GenerateResponse]:
        """The whole request on one `both` worker (or a migrated one, resumed from the tokens sent)."""
        req = worker_pb2.GenerateRequest(request_id=rid, prompt_token_ids=sub.prompt_token_ids, params=pp,
                                         namespace=namespace, lifecycle=lifecycle)
        if resume is not None:
            req.resume.output_token_ids.extend(resume)
        prompt_len = len(sub.prompt_token_ids) + len(resume or ())
        call = self.stub(both.address).Generate(req)
        done = False
        try:
            async for m in watched(call, at.worker_id, self._listed):
                at.emitted = True
                trace.on_stream(m.times)
                if resume is not None and m.finished:
                    # recomputed: what the new worker prefilled again, less its prefix-cache hit
                    done, c = True, m.usage.cached_tokens
                    trace.recomputed_tokens += prompt_len - c
                    m.usage.cached_tokens = min(c, len(sub.prompt_token_ids))  # of the prompt
                yield m
        finally:
            call.cancel()
            if resume is not None and at.emitted and not done:
                trace.recomputed_tokens += prompt_len  # it answered, then broke: no hit known

    async def _disaggregated(self, rid: str, sub: SubRequest, pp, namespace: str, route, trace: StageTrace,
                             lifecycle, at: _Attempt) -> AsyncIterator[common_pb2.GenerateResponse]:
        """Prefill on the prefill worker, then the decode worker's stream. Whatever way this ends other than the
        decode stream's normal end (or a prefill that pinned nothing), the prefill side's KV is released."""
        pcall = self.stub(route.prefill.address).Prefill(worker_pb2.PrefillRequest(
            request_id=rid, prompt_token_ids=sub.prompt_token_ids, params=pp, namespace=namespace,
            lifecycle=lifecycle))
        handed_over = False  # the decode stream ended normally: its pull released the prefill side
        try:
            try:
                pre = await pcall
            except grpc.aio.AioRpcError:
                handed_over = True  # the worker answered with an error: it pinned nothing
                raise
            finally:
                pcall.cancel()
            trace.on_prefill(pre.times)
            if pre.finished:
                handed_over = True  # the prefill worker ended it: nothing pinned
                at.emitted = True
                trace.on_prefill(pre.final.times)  # the prefill worker's engine finished it
                yield pre.final
                return
            skip = None
            if pre.HasField("first"):
                # The first token goes to the client now; the KV transfer and the decode worker's pickup (~5 ms)
                # run behind it, off the TTFT path. The decode stream repeats it: left out.
                at.emitted = True
                skip = _SkipFirst(pre.first)
                yield pre.first
            try:
                async for m in self._decode(rid, sub, pp, namespace, route, pre, lifecycle):
                    trace.on_stream(m.times)
                    if m.finished and (m.state or "FINISHED") == "FINISHED":
                        handed_over = True
                    if m.finished and m.state == "FAILED" and m.retryable:
                        # the decode worker could not pull the KV: the prefill worker (or its incarnation that
                        # pinned it) is gone; place the request again without it
                        raise Broken(route.prefill.worker_id, KV_TRANSFER, m.error or "KV transfer failed")
                    if skip is not None and not skip(m):
                        continue
                    at.emitted = True
                    yield m
            except (UpstreamError, NoWorkersError) as e:
                if not at.emitted:
                    raise
                # after the first token went out a refusal can only end the stream, as FAILED; no decode worker
                # left is the deployment's state, not the request's: marked retryable (503 where nothing was sent)
                yield common_pb2.GenerateResponse(request_id=rid, finished=True, state="FAILED",
                                                  error=f"decode failed: {e}",
                                                  retryable=isinstance(e, NoWorkersError))
        finally:
            if not handed_over:
                self._release_soon(route.prefill.address, rid)

    async def _decode(self, rid, sub, pp, namespace, route, pre,
                      lifecycle: common_pb2.Lifecycle | None = None) -> AsyncIterator[common_pb2.GenerateResponse]:
        kv = pre.kv
        exclude = [route.decode.worker_id]
        decode = route.decode
        for attempt in range(self.max_attempts):
            call = self.stub(decode.address).GenerateFromPrefill(worker_pb2.GenerateFromPrefillRequest(
                request_id=rid, prompt_token_ids=sub.prompt_token_ids, params=pp, namespace=namespace,
                first_tokens=pre.first_tokens, kv=kv, lifecycle=lifecycle))
            emitted = False
            try:
                async for m in watched(call, decode.worker_id, self._listed):
                    emitted = True
                    yield m
                return
            except (grpc.aio.AioRpcError, Broken) as e:
                if isinstance(e, Broken):  # silent and unregistered: it holds the pull or the stream
                    self._release_soon(kv.worker_address, rid, kv.lease_id)
                    raise
                unreachable = e.code() == grpc.StatusCode.UNAVAILABLE and not emitted
                if not unreachable or attempt == self.max_attempts - 1:
                    self._release_soon(kv.worker_address, rid, kv.lease_id)
                    if not emitted and e.code() != grpc.StatusCode.UNAVAILABLE:
                        raise UpstreamError(e.code(), e.details() or "", param_of(e)) from None
                    if broken_by(e):  # mid-stream, or no decode worker reachable: another worker takes it over
                        raise Broken(decode.worker_id, break_reason(e), f"decode worker {decode.worker_id} "
                                                                        f"failed: {e.code().name}: {e.details()}"
                                     ) from None
                    yield common_pb2.GenerateResponse(
                        request_id=rid, finished=True, state="FAILED",
                        error=f"decode worker {decode.worker_id} failed: {e.code().name}: {e.details()}")
                    return
                # the KV is still pinned on the prefill side: another decode worker can pull it
                log.warning("request %s: decode worker %s unreachable (%s), trying another", rid, decode.worker_id,
                            e.details())
                if not is_refusal(e.details()):
                    self.suspects.add(decode.worker_id)
                try:
                    # the prompt is already prefilled: only another decode worker helps now
                    r2 = await self.route(rid, len(sub.prompt_token_ids), namespace, exclude, prefer="disagg")
                except NoWorkersError:
                    self._release_soon(kv.worker_address, rid, kv.lease_id)
                    raise
                if r2.mode != "disagg":
                    self._release_soon(kv.worker_address, rid, kv.lease_id)
                    raise NoWorkersError("no decode worker left")
                decode = r2.decode
                exclude.append(decode.worker_id)
            finally:
                call.cancel()

    def _release_soon(self, address: str, rid: str, lease_id: str = "") -> None:
        """ReleaseKV in an owned task: the caller is often a generator being closed by a cancellation, where an
        await would be interrupted. Idempotent on the worker; the lease's expiry is the backstop if it fails."""
        async def release() -> None:
            try:
                await self.stub(address).ReleaseKV(
                    worker_pb2.ReleaseKVRequest(request_id=rid, lease_id=lease_id), timeout=2)
            except grpc.aio.AioRpcError as e:
                log.warning("ReleaseKV %s on %s failed: %s (the lease will expire)", rid, address, e.code().name)
        self._tasks.spawn(release())

    async def generate_many(self, rid: str, subs: list[SubRequest], namespace: str = "", on_route=None,
                            traces: list[StageTrace] | None = None,
                            lifecycle: common_pb2.Lifecycle | None = None,
                            first_route: router_pb2.RouteResponse | None = None
                            ) -> AsyncIterator[tuple[int, common_pb2.GenerateResponse]]:
        """Several sub-requests (one per prompt) merged into one stream; yields (sub index, message) with each
        message's choice indexes already shifted to the response's numbering. `traces[i]` is sub-request i's."""
        traces = traces if traces is not None else [StageTrace() for _ in subs]
        if len(subs) == 1:
            async for m in self.generate(rid, subs[0], namespace, on_route, traces[0], lifecycle, first_route):
                _shift(m, subs[0].index_base)
                yield 0, m
            return
        # Bounded: a slow client must stop the pumps pulling their gRPC streams, or its backpressure never
        # reaches the workers (the queue would hold the whole output instead of their bounded buffers).
        q: asyncio.Queue = asyncio.Queue(maxsize=RELAY_QUEUE_PER_SUB * len(subs))

        async def pump(i: int, sub: SubRequest) -> None:
            try:
                async for m in self.generate(f"{rid}-{i}", sub, namespace, on_route, traces[i], lifecycle):
                    _shift(m, sub.index_base)
                    await q.put((i, m))
            except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
                await q.put((i, e))
            finally:
                await q.put((i, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(subs)]
        try:
            live = len(tasks)
            while live:
                i, m = await q.get()
                if m is None:
                    live -= 1
                elif isinstance(m, BaseException):
                    raise m
                else:
                    yield i, m
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


class _SkipFirst:
    """Leaves out of a decode worker's stream the first tokens the gateway already emitted from the
    PrefillResponse, branch by branch: each one's token id, its text (the decode engine detokenizes it to the same
    characters, hold-back included) and its logprob, wherever the stream's deltas put them."""

    def __init__(self, first: common_pb2.GenerateResponse):
        # choice index -> [tokens, chars, logprobs] still owed
        self.owed = {d.index: [len(d.token_ids), len(d.text), len(d.logprobs)] for d in first.outputs}

    def __call__(self, m: common_pb2.GenerateResponse) -> bool:
        """Strip what is still owed from `m`; return whether anything is left to send."""
        for d in m.outputs:
            owed = self.owed.get(d.index)
            if owed is None:
                continue
            k = min(owed[0], len(d.token_ids))
            del d.token_ids[:k]
            owed[0] -= k
            k = min(owed[1], len(d.text))
            d.text = d.text[k:]
            owed[1] -= k
            k = min(owed[2], len(d.logprobs))
            del d.logprobs[:k]
            owed[2] -= k
        return m.finished or bool(m.error) or any(d.token_ids or d.text or d.finish_reason for d in m.outputs)


def _shift(m: common_pb2.GenerateResponse, base: int) -> None:
    if base:
        for o in m.outputs:
            o.index += base


def split(prompts: list[list[int]], params: SamplingParams) -> list[SubRequest]:
    """One engine request per prompt, carrying the whole n / best_of: its branches are copy-on-write forks of one
    sequence on one worker (one prompt prefill, the prompt's KV shared; in disaggregated mode one transfer and
    the fork on the decode worker), exactly as admission booked it. Prompt i's branch j is choice i * n + j."""
    return [SubRequest(ids, params, pi * params.n) for pi, ids in enumerate(prompts)]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"
