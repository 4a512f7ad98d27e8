"""The one request handler behind both front doors (HTTP `create_gateway`, gRPC `GatewayGrpc`).

A request's path: `authorize` (stage one: key -> tenant, quota, rate) -> the front door parses its wire format
into a `GenerateCall` -> `start` (deadline, admission, dispatch, the first upstream message pulled so that a
refusal is still an error reply) -> `consume`, the one consumer of the upstream stream, for streaming and
non-streaming answers alike. Every terminal path goes through one of three methods, each once per request:
`consume` ends FINISHED, `fail` ends any error (typed reply + terminal state + rejection counter), `cancel`
ends a request whose client left.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import replace
from typing import AsyncIterator, Awaitable, Callable

from pdserve.services import tracing
from pdserve.services.convert import lifecycle_to_pb
from pdserve.services.gateway.dispatch import Dispatcher, new_id, split
from pdserve.services.gateway.errors import ErrorReply, RequestFailed, reply_for
from pdserve.services.gateway.lifecycle import RequestLifecycle, RequestRecord
from pdserve.services.gateway.path import PathHeader, path_of
from pdserve.services.gateway.schema import FINISH_REASONS, ActiveRequest, Degraded, Delta, GenerateCall
from pdserve.services.gateway.stages import StageTrace, emit_spans, pick, stage_times
from pdserve.services.gateway.timing import Timing
from pdserve.services.metrics import gateway as M
from pdserve.services.pb import router_pb2
from pdserve.services.prefix_pins import PrefixHit, hit_of, kv_holder


class RequestHandler:
    def __init__(self, life: RequestLifecycle, dispatcher: Dispatcher, max_model_len: int):
        self.life, self.disp, self.max_len = life, dispatcher, max_model_len

    def new_record(self) -> RequestRecord:
        return self.life.new_record()

    async def open(self, rec: RequestRecord, headers, parse: Callable[[], Awaitable[GenerateCall]]) -> ActiveRequest:
        """Stage one (`headers`: HTTP headers or gRPC metadata; an HTTP body was read within its limits before),
        then `parse` (the front door's wire format -> GenerateCall), then `start`. Raises for `fail`."""
        await self.life.authorize(rec, headers)
        return await self.start(rec, await parse())

    async def start(self, rec: RequestRecord, call: GenerateCall) -> ActiveRequest:
        """Admit and dispatch; raises (for `fail`) if the request is refused before its first message."""
        params = call.params
        deadline = self.life.deadline_for(call.timeout_s, rec)
        # Always the gateway's own: reservations, leases, ReleaseKV and billing are keyed by it, so a caller's id
        # (another tenant's, repeated, huge) can touch nothing but the label echoed back.
        rid = new_id(call.id_prefix)
        # stage two: reserve KV for prompt + predicted output of every branch (best_of of them, when asked: the
        # worker runs them all); may queue, degrade the branch count, or reject
        # (never a narrower beam: that would change the answer, not only its count)
        rec.request_id, rec.prompt_tokens = rid, sum(len(p) for p in call.prompts)  # billed if placing fails
        first_route, hit = await self._placement(rec, rid, call)
        ticket = await self.life.admit(rec, rid, call.prompts, params.max_tokens, params.num_branches,
                                       self.max_len, allow_degrade=call.allow_degrade and not params.beam, hit=hit)
        if ticket is not None and ticket.queued_s:
            first_route = None  # placed before it waited: the load has moved, ask again (the hit may stay)
        headers: dict[str, str] = {}
        params, degraded = _degrade(params, ticket, headers)
        subs = split(call.prompts, params)
        traces = [StageTrace() for _ in subs]
        rec.traces = traces  # the usage record reads their migrations
        if tracing.enabled():  # the stages as spans once the response is out (docs/observability.md)
            tracing.at_request_end(lambda: emit_spans(rec.arrival, rec.admitted_at, traces))
        timing = Timing(rec=rec)
        routes: list[str] = []
        paths = PathHeader(len(subs), headers)

        def on_route(r) -> None:
            timing.mode = r.mode
            if len(routes) < len(subs):  # each sub-request's first placement (a retry or migration is not counted)
                M.REQUESTS_BY_PATH.labels(path_of(r.mode, r.reason), r.reason or "unknown").inc()
            paths.place(r.mode, r.reason)
            routes.append(r.debug)
            if hit is not None and kv_holder(r) != hit.worker_id:
                self.life.spawn(self.life.admission.lose_hit(rid))  # its KV is elsewhere: its pins are its own

        # the limits every worker obeys travel as a field of its request (metadata carries only tracing headers)
        lifecycle = lifecycle_to_pb(deadline, call.priority_for(rec.tenant.priority),
                                    ticket.predicted_output if ticket is not None else None,
                                    rec.tenant.kv_share)  # 0 too: a share lowered in the keys file is lifted
        upstream = self.disp.generate_many(rid, subs, rec.tenant.namespace, on_route=on_route, traces=traces,
                                           lifecycle=lifecycle, first_route=first_route)
        first = await _first_message(deadline, upstream)
        if call.debug_route and rec.tenant.can("debug_route"):
            headers["x-pdserve-route"] = " | ".join(routes)
        n = sum(s.n_choices for s in subs)
        return ActiveRequest(rid, int(time.time()), call, rec, subs, traces, timing, upstream, first, degraded,
                            routes, headers, tokens_per_choice=[0] * n, finish_reasons=[None] * n,
                            prompt_logprobs=[[] for _ in range(n)])

    async def _placement(self, rec: RequestRecord, rid: str, call: GenerateCall
                         ) -> tuple[router_pb2.RouteResponse | None, PrefixHit | None]:
        """Where the request will run, asked before admission (spec §0.1: the cache lookup comes before the
        reservation): the route the dispatcher takes first, and the placed worker's prefix-cache hit that
        admission pins instead of reserving anew (prefix_pins.hit_of: disaggregated, the decode worker's hit). Only
        with admission and one prompt (several are placed one by one, each where it fits)."""
        if self.life.admission is None or len(call.prompts) != 1:
            return None, None
        prompt, params = call.prompts[0], call.params
        route = await self.disp.route(rid, len(prompt), rec.tenant.namespace, [], prompt, params.max_tokens or 0,
                                      prefer="colocated" if params.beam else "")
        return route, hit_of(route, rec.tenant.namespace, prompt)

    async def consume(self, st: ActiveRequest, finish: bool = True) -> AsyncIterator[Delta]:
        """The upstream messages, counted (tokens, finish reasons, emit times, the record's counts). Ends the
        request FINISHED after the last one (`finish=False`: the caller calls `finish` once it has built the
        answer, which the deadline covers too); a failure reported by a worker raises `RequestFailed`, a broken
        upstream its own error: the caller passes either to `fail`."""
        rec, streamed = st.rec, st.call.streamed
        seen = [0] * len(st.subs)  # tokens each sub-request's messages carried
        async with contextlib.aclosing(st.upstream):
            async for i, m in _messages(st.first, st.upstream, rec.deadline):
                ntok = 0
                for o in m.outputs:
                    k = len(o.token_ids)
                    ntok += k
                    st.tokens_per_choice[o.index] += k
                    if o.finish_reason:
                        st.finish_reasons[o.index] = FINISH_REASONS.get(o.finish_reason, "stop")
                if m.prompt_logprobs:  # one sub-request = one prompt, shared by its choices (core.split)
                    sub = st.subs[i]
                    for c in range(sub.index_base, sub.index_base + sub.n_choices):
                        st.prompt_logprobs[c].extend(m.prompt_logprobs)
                seen[i] += ntok
                st.generated_tokens += ntok
                if m.finished and m.usage.generated_tokens > seen[i]:
                    # best_of > n: the worker sampled branches it did not return (its final usage says how many)
                    st.generated_tokens += m.usage.generated_tokens - seen[i]
                if st.call.prompt_only:
                    ntok = 0  # sampled, but not part of the answer
                st.completion_tokens += ntok
                if m.finished:
                    st.cached_tokens += m.usage.cached_tokens
                    if m.state and m.state != "FINISHED":
                        raise RequestFailed(m.state, m.error or m.state, m)
                if streamed:
                    # counted before the delta goes out: a client that leaves while it is written leaves the
                    # consumer suspended there, never resumed
                    rec.emitted += ntok
                t = st.timing.emit(ntok)
                if t is not None:
                    st.traces[i].on_emit(t)
                yield Delta(i, m, ntok)
        if finish:
            await self.finish(st)

    async def finish(self, st: ActiveRequest) -> None:
        """The answer is complete: the request ends FINISHED."""
        rec = st.rec
        st.timing.done()
        if not st.call.streamed:
            rec.emitted = st.completion_tokens  # the whole answer goes out at once
            # the output-length predictor learns from whole answers only: a streamed answer's admission learns
            # its service time from the emitted count instead (lifecycle._learn)
            rec.outputs_per_choice = list(st.tokens_per_choice)
        rec.committed = rec.emitted
        await self.life.finish(rec, "FINISHED")

    async def fail(self, rec: RequestRecord, e: BaseException) -> ErrorReply:
        """The request ended with `e`: its reply, and (once) its terminal state. What was streamed is billed."""
        reply = reply_for(e)
        if rec.state is None:
            if reply.rejection is not None:
                M.REJECTIONS.labels(reply.rejection).inc()
            rec.committed = rec.emitted
            detail = e.detail if isinstance(e, RequestFailed) else (str(e) if isinstance(e, Exception) else repr(e))
            await self.life.finish(rec, reply.state, detail or reply.state)
        return reply

    def cancel(self, st: ActiveRequest | None, rec: RequestRecord, reason: str, *gens) -> None:
        """The client left before the end: close `gens` (the front door's own generators) and the upstream calls
        (aborting the request on its workers, releasing pinned prefill KV), and end the request CANCELLED,
        billing what was streamed. Synchronous: it is called where the caller is being cancelled (an await there
        would be interrupted); the work runs in a task the RequestLifecycle owns."""
        async def cleanup() -> None:
            try:
                for gen in (*gens, st.upstream if st is not None else None):
                    if gen is not None:
                        with contextlib.suppress(RuntimeError):  # "already running": it is closing itself
                            await gen.aclose()
            finally:
                if rec.state is None:
                    rec.committed = rec.emitted
                await self.life.finish(rec, "CANCELLED", reason)
        self.life.spawn(cleanup())

    def stage_times(self, st: ActiveRequest) -> dict | None:
        """The `usage.stage_times` extension (docs/services.md, "Stage times"), when the call asked for it and
        its tenant may see it (`debug_stage_times`): ~1 KB that most clients never read."""
        if not (st.call.stage_times and st.rec.tenant.can("debug_stage_times")):
            return None
        i = pick(st.traces)
        return stage_times(st.rec.arrival, st.rec.admitted_at, st.traces[i], i, len(st.traces))


def _degrade(params, ticket, headers: dict[str, str]):
    """Fewer branches than asked, when admission granted fewer (best_of shrinks first, then n): the params to run
    and the `Degraded` note for the answer (None when not degraded); the header saying so goes into `headers`."""
    if ticket is None or not ticket.degraded:
        return params, None
    k = ticket.n_granted
    n = min(params.n, k)
    what = "best_of" if params.best_of is not None else "n"
    headers["x-pdserve-degraded"] = f"{what}={params.num_branches}->{k}"
    return replace(params, n=n, best_of=k if k > n else None), Degraded(params.n, n)


async def _first_message(deadline: float | None, upstream: AsyncIterator):
    """The first upstream message, pulled before the reply starts so that a refusal is still an error reply; None
    when the stream ends without one. Any failure closes the stream before it propagates."""
    try:
        return await _next_by(deadline, upstream)
    except StopAsyncIteration:
        return None
    except BaseException:
        await upstream.aclose()
        raise


async def _messages(first, upstream, deadline: float | None) -> AsyncIterator:
    """`first` (read by `start`), then the upstream's messages, every one by the deadline."""
    if first is not None:
        if deadline is not None and time.time() >= deadline:
            raise timed_out()
        yield first
    while True:
        try:
            m = await _next_by(deadline, upstream)
        except StopAsyncIteration:
            return
        yield m


# The workers end a request at its deadline themselves (it travels in their request's `Lifecycle`), but a worker
# that hangs (alive, connected, silent) cannot, and a relay running late must not hand the client its answer after
# the deadline either: the gateway holds the deadline too, on every upstream read (docs/reliability.md).
def timed_out() -> RequestFailed:
    return RequestFailed("TIMED_OUT", "the request's deadline passed before its answer reached the gateway")


async def _next_by(deadline: float | None, it: AsyncIterator):
    """`await it.__anext__()`, given up at the unix time `deadline` (cancelling the read: the upstream generator
    aborts its calls on the workers as it does for a client that left)."""
    if deadline is None:
        return await it.__anext__()
    left = deadline - time.time()
    if left <= 0:
        raise timed_out()
    cm = asyncio.timeout(left)  # raises TimeoutError only when no other cancellation (a client that left) races it
    try:
        async with cm:
            return await it.__anext__()
    except TimeoutError:
        if cm.expired():  # ours, not a TimeoutError from inside the read
            raise timed_out() from None
        raise
