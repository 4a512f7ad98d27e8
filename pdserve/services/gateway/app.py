"""OpenAI-compatible HTTP API (FastAPI) and the gRPC Gateway front door.

Latency metrics use the gateway as the system boundary (spec §2.1): arrival = request received here, emit = a
chunk with new tokens handed to the client.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator

import grpc
from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pdserve.engine.config import ModelConfig
from pdserve.engine.engine import resolve_model_dir
from pdserve.engine.tokenizer import Tokenizer
from pdserve.services import metrics as M
from pdserve.services.admission import AdmissionError
from pdserve.services.convert import lifecycle_to_pb
from pdserve.services.gateway import redact
from pdserve.services.gateway.core import Dispatcher, NoWorkersError, UpstreamError, new_id, split
from pdserve.services.gateway.lifecycle import Lifecycle, RequestRecord, build_lifecycle
from pdserve.services.gateway.params import APIError, bad, to_sampling_params
from pdserve.services.gateway.guard import MAX_HEADER_BYTES, HttpGuard  # noqa: I001 - out of order: fewer merge conflicts
from pdserve.services.gateway.ingress import IngressGate
from pdserve.services.gateway.parse import RequestParser
from pdserve.services.gateway.stages import StageTrace, pick, stage_times
from pdserve.services.pb import common_pb2

log = logging.getLogger("pdserve.gateway")

_FINISH = {"stop": "stop", "length": "length"}


@dataclass
class GatewayConfig:
    model: str  # dir or "builtin"
    served_model_name: str
    router_address: str
    # request lifecycle (docs/admission.md); no redis_url: no reservations, per-replica rate limits
    redis_url: str | None = None
    api_keys_file: str | None = None
    max_body_bytes: int = 1 << 20
    default_timeout_s: float = 60.0
    max_timeout_s: float = 600.0
    admission_queue: int = 16
    max_queue_wait_s: float = 10.0
    kv_overcommit: float = 1.0
    reservation_lease_s: float = 10.0
    # slow clients and big heads (docs/reliability.md, "Hostile input"): server.py hands these to uvicorn
    max_header_bytes: int = MAX_HEADER_BYTES
    header_timeout_s: float = 10.0  # connection open (or idle keep-alive) -> request head complete
    body_timeout_s: float = 30.0  # request head -> body complete (ingress.read_body)


class Timing:
    """Per-request emit times -> TTFT / ITL / TPOT / E2E histograms (spec §2.1)."""

    def __init__(self, mode: str = "unknown", rec: RequestRecord | None = None):
        self.rec = rec
        self.arrival = rec.arrival if rec is not None else time.time()
        self.mode = mode
        self.first: float | None = None
        self.last: float | None = None
        self.n = 0

    def emit(self, ntok: int) -> float | None:
        """Record a token-bearing emit; returns its timestamp (the sub-request's stage trace uses the same one)."""
        if ntok <= 0:
            return None
        now = time.time()
        if self.first is None:
            self.first = now
            M.TTFT.labels(self.mode).observe(now - self.arrival)
        else:
            M.ITL.labels(self.mode).observe(now - self.last)
        self.last = now
        self.n += ntok
        if self.rec is not None:
            self.rec.first_emit, self.rec.last_emit = self.first, now
        return now

    def done(self) -> None:
        if self.last is not None:
            M.E2E.labels(self.mode).observe(self.last - self.arrival)
            if self.n >= 2:
                M.TPOT.labels(self.mode).observe((self.last - self.first) / (self.n - 1))


def _error_response(e: Exception) -> JSONResponse:
    """An error as the client sees it. Router / worker details stay in the log, under the request id
    (redact.py): they name workers, addresses and library build paths."""
    if isinstance(e, APIError):
        M.REJECTIONS.labels(e.code or e.type).inc()
        return JSONResponse(e.body(), status_code=e.status, headers=getattr(e, "headers", None))
    rid = redact.request_id.get()
    if isinstance(e, NoWorkersError):
        log.warning("request %s: no workers: %s", rid, e)
        M.REJECTIONS.labels("no_workers").inc()
        return JSONResponse(APIError(503, redact.with_id("no workers available"), "service_unavailable_error",
                                     code="no_workers").body(), status_code=503)
    if isinstance(e, UpstreamError):
        log.warning("request %s: worker answered %s: %s", rid, e.code.name, e.details)
        if e.code == grpc.StatusCode.INVALID_ARGUMENT:  # about the client's input: its text, scrubbed
            import re
            details = redact.scrub(e.details)
            m = re.search(r"'([^']+)'", details)
            M.REJECTIONS.labels("invalid_request").inc()
            return JSONResponse(APIError(400, details, param=m.group(1) if m else None,
                                         code="invalid_parameter").body(), status_code=400)
        if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            M.REJECTIONS.labels("capacity").inc()
            return JSONResponse(APIError(503, redact.with_id("no capacity for this request now"),
                                         "service_unavailable_error", code="capacity").body(),
                                status_code=503, headers={"Retry-After": "1"})
        return JSONResponse(APIError(500, redact.with_id("a worker failed the request"), "server_error",
                                     code=e.code.name.lower()).body(), status_code=500)
    log.error("request %s: unexpected error", rid, exc_info=e)
    return JSONResponse(APIError(500, redact.with_id("internal error"), "server_error").body(), status_code=500)


class _Abandon:
    """The end of a stream that did not reach its `[DONE]`: close the body and the upstream calls (aborting the
    request on its workers, releasing pinned prefill KV) and end the request CANCELLED, billing what was streamed.
    Calling it is synchronous and idempotent: it is called where the caller is being cancelled (an await there
    would be interrupted), possibly twice (the body's `finally` and the response's), and the work runs in a task
    the Lifecycle owns."""

    def __init__(self, life: Lifecycle, rec: RequestRecord, agen):
        self.life, self.rec, self.agen = life, rec, agen
        self.body = None
        self.called = False

    def __call__(self) -> None:
        if not self.called:
            self.called = True
            self.life.spawn(self._cleanup())

    async def _cleanup(self) -> None:
        try:
            for gen in (self.body, self.agen):
                if gen is not None:
                    with contextlib.suppress(RuntimeError):  # "already running": it is closing itself
                        await gen.aclose()
        finally:
            if self.rec.state is None:
                self.rec.committed = self.rec.emitted  # streamed tokens reached the client: they are billed
            await self.life.finish(self.rec, "CANCELLED", "client disconnected")


class _OwnedStream(StreamingResponse):
    """A streaming response whose end always runs `on_close`, however it ends: after the last chunk, on a client
    disconnect (Starlette cancels the send; the body generator is left suspended at a yield and never resumed,
    so its own `finally` does not run), on an error, or before the first chunk was ever pulled."""

    def __init__(self, content, on_close, **kwargs):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _sse(obj) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def create_app(cfg: GatewayConfig, dispatcher: Dispatcher | None = None) -> FastAPI:
    model_dir = resolve_model_dir(cfg.model)
    tok = Tokenizer(model_dir)
    mcfg = ModelConfig.from_dir(model_dir)
    vocab = mcfg.vocab_size
    max_len = mcfg.max_model_len
    disp = dispatcher or Dispatcher(cfg.router_address, cfg.served_model_name)
    app = FastAPI(title="pdserve gateway")
    app.add_middleware(HttpGuard, max_header_bytes=cfg.max_header_bytes)
    app.state.dispatcher = disp
    app.state.config = cfg
    app.state.tokenizer = tok
    life = build_lifecycle(cfg)
    app.state.lifecycle = life

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return _error_response(exc)

    parser = RequestParser(tok, vocab, max_len, cfg.served_model_name)  # parse.py: strict, 400 naming the field
    app.state.parser = parser

    async def _body(raw: bytes) -> dict:
        return parser.body(raw)

    async def _run(request: Request, body: dict, chat: bool, rec: RequestRecord):
        params = to_sampling_params(body, chat=chat, vocab_size=vocab)
        deadline = life.deadline_for(body, rec)
        prompts = [await parser.chat_prompt(body)] if chat else await parser.completion_prompts(body)
        rid = new_id("chatcmpl" if chat else "cmpl")
        # stage two: reserve KV for prompt + predicted output (may queue, degrade n, or reject)
        ticket = await life.admit(rec, rid, prompts, params.max_tokens, params.n, max_len,
                                  allow_degrade=body.get("allow_degrade", True) is not False)
        headers = {}
        if ticket is not None and ticket.degraded:
            from dataclasses import replace as _replace
            headers["x-pdserve-degraded"] = f"n={params.n}->{ticket.n_granted}"
            params = _replace(params, n=ticket.n_granted, best_of=None)
        subs = split(prompts, params)
        stream = bool(body.get("stream", False))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage", False))
        timing = Timing(rec=rec)
        routes: list[str] = []  # the router's decision(s): `x-pdserve-debug: route` returns them (docs/routing.md)

        def on_route(r) -> None:
            timing.mode = r.mode
            routes.append(r.debug)

        lifecycle = lifecycle_to_pb(deadline, rec.tenant.priority,
                                    ticket.predicted_output if ticket is not None else None)
        traces = [StageTrace() for _ in subs]
        agen = disp.generate_many(rid, subs, rec.tenant.namespace, on_route=on_route, traces=traces,
                                  lifecycle=lifecycle)
        try:
            first = await agen.__anext__()
        except StopAsyncIteration:
            first = None
        except BaseException as e:
            await agen.aclose()
            if isinstance(e, (APIError, NoWorkersError, UpstreamError)):
                await life.finish(rec, "FAILED" if isinstance(e, UpstreamError) else "REJECTED", str(e))
                return _error_response(e)
            await life.finish(rec, "CANCELLED" if isinstance(e, asyncio.CancelledError) else "FAILED", repr(e))
            raise
        ctx = dict(rid=rid, created=int(time.time()), chat=chat, prompts=prompts, n_choices=len(subs),
                   params=params, return_token_ids=bool(body.get("return_token_ids", False)), rec=rec,
                   headers=headers, traces=traces, degraded=({"n_requested": ticket.n_requested, "n_granted": ticket.n_granted}
                                              if ticket is not None and ticket.degraded else None))
        if request.headers.get("x-pdserve-debug") == "route" and rec.tenant.can("debug_route"):
            headers["x-pdserve-route"] = " | ".join(routes)
        if stream:
            abandon = ctx["abandon"] = _Abandon(life, rec, agen)
            abandon.body = _stream(first, agen, ctx, include_usage, timing)
            return _OwnedStream(abandon.body, abandon, media_type="text/event-stream",
                                headers={"Cache-Control": "no-cache", **headers})
        task = asyncio.create_task(_collect(first, agen, ctx, timing))
        # a non-streaming client that disconnects must not keep the workers busy
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if not done and await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
                await life.finish(rec, "CANCELLED", "client disconnected")
                return Response(status_code=499)
        try:
            resp = task.result()
        except _Failed as e:
            await life.finish(rec, e.state, str(e))
            raise
        except BaseException as e:
            await life.finish(rec, "FAILED", repr(e))
            raise
        await life.finish(rec, "FINISHED")
        return resp

    def _choice_logprobs(chat: bool, lps: list) -> dict | None:
        if chat:
            return {"content": [{"token": l.token, "logprob": l.logprob, "bytes": list(l.token.encode()),
                                 "top_logprobs": [{"token": t.token, "logprob": t.logprob,
                                                   "bytes": list(t.token.encode())} for t in l.top]}
                                for l in lps]}
        return {"tokens": [l.token for l in lps], "token_logprobs": [l.logprob for l in lps],
                "top_logprobs": [{t.token: t.logprob for t in l.top} for l in lps], "text_offset": []}

    def _usage(ctx, completion: int, cached: int) -> dict:
        pt = sum(len(p) for p in ctx["prompts"])
        rec, traces = ctx["rec"], ctx["traces"]
        i = pick(traces)
        # extension: per-request stage timestamps and durations (docs/services.md, "Stage times")
        st = stage_times(rec.arrival, rec.admitted_at, traces[i], i, len(traces))
        return {"prompt_tokens": pt, "completion_tokens": completion, "total_tokens": pt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}, "stage_times": st}

    def _emitted(ctx, i: int, t: float | None) -> None:
        if t is not None:
            ctx["traces"][i].on_emit(t)

    async def _messages(first, agen) -> AsyncIterator[common_pb2.GenerateResponse]:
        if first is not None:
            yield first
        async for x in agen:
            yield x

    async def _collect(first, agen, ctx, timing: Timing):
        chat = ctx["chat"]
        texts = [""] * ctx["n_choices"]
        ids: list[list[int]] = [[] for _ in texts]
        lps: list[list] = [[] for _ in texts]
        reasons: list[str | None] = [None] * len(texts)
        completion = cached = 0
        want_lp = ctx["params"].logprobs is not None
        async with contextlib.aclosing(agen):
            async for i, m in _messages(first, agen):
                ntok = 0
                for o in m.outputs:
                    texts[o.index] += o.text
                    ids[o.index].extend(o.token_ids)
                    lps[o.index].extend(o.logprobs)
                    ntok += len(o.token_ids)
                    if o.finish_reason:
                        reasons[o.index] = _FINISH.get(o.finish_reason, "stop")
                completion += ntok
                _emitted(ctx, i, timing.emit(ntok))
                if m.finished:
                    cached += m.usage.cached_tokens
                    if m.state and m.state != "FINISHED":
                        ctx["rec"].generated = completion
                        raise _Failed(m.error or m.state, m.state)
        timing.done()
        rec = ctx["rec"]
        rec.generated = rec.emitted = rec.committed = completion
        rec.cached_tokens = cached
        rec.outputs_per_choice = [len(x) for x in ids]
        choices = []
        for i, t in enumerate(texts):
            c = {"index": i, "finish_reason": reasons[i] or "stop",
                 "logprobs": _choice_logprobs(chat, lps[i]) if want_lp else None}
            if chat:
                c["message"] = {"role": "assistant", "content": t}
            else:
                c["text"] = t
            if ctx["return_token_ids"]:  # extension (vLLM-style): exact ids, for clients that detokenize
                c["token_ids"] = ids[i]
            choices.append(c)
        out = {"id": ctx["rid"], "object": "chat.completion" if chat else "text_completion",
               "created": ctx["created"], "model": cfg.served_model_name, "choices": choices,
               "usage": _usage(ctx, completion, cached)}
        if ctx["degraded"]:  # DEGRADED: fewer choices than asked, said in the body and the x-pdserve-degraded header
            out["pdserve"] = {"degraded": ctx["degraded"]}
        return JSONResponse(out, headers=ctx["headers"])

    async def _stream(first, agen, ctx, include_usage: bool, timing: Timing) -> AsyncIterator[bytes]:
        chat = ctx["chat"]
        obj = "chat.completion.chunk" if chat else "text_completion"
        base = {"id": ctx["rid"], "object": obj, "created": ctx["created"], "model": cfg.served_model_name}
        want_lp = ctx["params"].logprobs is not None
        completion = cached = 0
        ok = False
        rec = ctx["rec"]
        try:
            if ctx["degraded"]:
                yield _sse({**base, "choices": [], "pdserve": {"degraded": ctx["degraded"]}})
            if chat:
                yield _sse({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}
                                                for i in range(ctx["n_choices"])]})
            async with contextlib.aclosing(agen):
                async for i, m in _messages(first, agen):
                    choices = []
                    ntok = 0
                    for o in m.outputs:
                        ntok += len(o.token_ids)
                        fr = _FINISH.get(o.finish_reason, "stop") if o.finish_reason else None
                        if not o.text and not o.token_ids and fr is None:
                            continue
                        c = {"index": o.index, "finish_reason": fr,
                             "logprobs": _choice_logprobs(chat, list(o.logprobs)) if want_lp and o.logprobs else None}
                        if chat:
                            c["delta"] = {"content": o.text} if o.text or fr is None else {}
                        else:
                            c["text"] = o.text
                        choices.append(c)
                    completion += ntok
                    rec.generated = completion
                    if m.finished:
                        cached += m.usage.cached_tokens
                        if m.state and m.state != "FINISHED":
                            # the request failed or timed out mid-stream: an error event, no [DONE]
                            rec.committed = rec.emitted
                            await life.finish(rec, m.state, m.error or m.state)
                            yield _sse({"error": {"message": redact.failure_message(m.state, m.error),
                                                  "type": "timeout_error" if m.state == "TIMED_OUT" else "server_error",
                                                  "param": None, "code": m.state.lower()}})
                            return
                    # counted before the yield: the chunk is handed to the connection there, and a client that
                    # leaves while it is written leaves this generator suspended at the yield, never resumed
                    rec.emitted += ntok
                    _emitted(ctx, i, timing.emit(ntok))
                    if choices:
                        yield _sse({**base, "choices": choices})
            timing.done()
            rec.committed = rec.emitted
            rec.cached_tokens = cached
            await life.finish(rec, "FINISHED")
            if include_usage:
                yield _sse({**base, "choices": [], "usage": _usage(ctx, completion, cached)})
            yield b"data: [DONE]\n\n"
            ok = True
        except (NoWorkersError, UpstreamError) as e:
            r = _error_response(e)
            rec.committed = rec.emitted
            await life.finish(rec, "FAILED", str(e))
            yield _sse(json.loads(r.body))
        finally:
            if not ok:
                ctx["abandon"]()

    class _Failed(Exception):
        def __init__(self, msg: str, state: str = "FAILED"):
            super().__init__(msg)
            self.state = state

    @app.exception_handler(_Failed)
    async def _failed(request, exc):
        msg = redact.failure_message(exc.state, str(exc))  # the worker's text is logged, not sent
        if exc.state == "TIMED_OUT":  # the request's deadline passed (queued, preempted or running)
            return JSONResponse(APIError(504, msg, "timeout_error", code="timeout").body(), status_code=504)
        return JSONResponse(APIError(500, msg, "server_error", code="failed").body(), status_code=500)

    async def _endpoint(request: Request, chat: bool):
        rec = life.new_record()
        try:
            raw = await life.ingress(request, rec)  # stage one, before parsing or tokenizing
            return await _run(request, await _body(raw), chat, rec)
        except AdmissionError as e:
            await life.finish(rec, e.state, e.message)
            status, body, headers = life.error_response_parts(e)
            if e.state == "REJECTED":
                M.REJECTIONS.labels(e.code).inc()
            return JSONResponse(body, status_code=status, headers=headers)
        except (APIError, NoWorkersError, UpstreamError) as e:
            await life.finish(rec, "FAILED" if isinstance(e, UpstreamError) else "REJECTED", str(e))
            return _error_response(e)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _endpoint(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _endpoint(request, chat=True)

    def _model_card() -> dict:
        return {"id": cfg.served_model_name, "object": "model", "created": 0, "owned_by": "pdserve",
                "max_model_len": max_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != cfg.served_model_name:
            raise APIError(404, f"The model '{model_id}' does not exist", "invalid_request_error", "model",
                           "model_not_found")
        return _model_card()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        # unknown routes and methods answer as the OpenAI API does (clients parse `error`, not `detail`)
        if exc.status_code == 404:
            body = APIError(404, f"Unknown request URL: {request.method} {request.url.path}",
                            "invalid_request_error", code="unknown_url").body()
        elif exc.status_code == 405:
            body = APIError(405, f"Method {request.method} not allowed for {request.url.path}",
                            "invalid_request_error", code="method_not_allowed").body()
        else:
            body = APIError(exc.status_code, str(exc.detail), "invalid_request_error").body()
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.get("/health")
    async def health():
        try:
            ws = await disp.list_workers()
        except grpc.aio.AioRpcError as e:
            return JSONResponse({"status": "unavailable", "reason": f"router: {e.code().name}"}, status_code=503)
        roles: dict[str, int] = {}
        for w in ws.workers:
            roles[w.role] = roles.get(w.role, 0) + 1
        ready = roles.get("both", 0) > 0 or (roles.get("prefill", 0) > 0 and roles.get("decode", 0) > 0)
        return JSONResponse({"status": "ok" if ready else "no_workers", "workers": roles},
                            status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics(request: Request):
        # every tenant's name and counts: only for a key with the `metrics` permission (docs/admission.md,
        # "Trust model"); a scraper inside the cluster can use --metrics-port instead
        tenant = life.gate.tenants.authenticate(IngressGate.api_key(request.headers))
        if tenant is None:
            return _error_response(APIError(401, "missing or invalid API key", "authentication_error",
                                            code="invalid_api_key"))
        if not tenant.can("metrics"):
            return _error_response(APIError(403, "this API key may not read metrics", "permission_error",
                                            code="permission_denied"))
        return PlainTextResponse(generate_latest().decode(), media_type=CONTENT_TYPE_LATEST)

    return app
