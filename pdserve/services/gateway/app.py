"""The HTTP front door: the OpenAI-compatible API (FastAPI) over the gateway's one request handler (handler.py).

This module reads HTTP (the body within its limits, headers, client disconnects) and writes it (JSON, server-sent
events, error bodies); admission, dispatch, counting, billing and metrics are the handler's, shared with the gRPC
front door (grpc_front.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from dataclasses import dataclass, field

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from pdserve.engine.checkpoint import resolve_model_dir, serving_limits
from pdserve.engine.grammar_limits import GrammarLimits
from pdserve.engine.sampling_params import GuidedSpec
from pdserve.engine.tokenizer import Tokenizer
from pdserve.services.gateway import http_metrics, openapi, responses, tokenize
from pdserve.services.gateway.dispatch import Dispatcher
from pdserve.services.gateway.errors import ErrorReply, reply_for
from pdserve.services.gateway.fields import MAX_PRIORITY
from pdserve.services.gateway.guard import MAX_HEADER_BYTES, HttpGuard, fastapi_options
from pdserve.services.gateway.handler import RequestHandler
from pdserve.services.gateway.ingress import IngressGate
from pdserve.services.gateway.lifecycle import RequestLifecycle, build_lifecycle
from pdserve.services.gateway.origin import BrowserGuard, allowed_hosts
from pdserve.services.gateway.params import (
    DEFAULT_MAX_LOGPROB_ENTRIES,
    APIError,
    _num,
    check_guided,
    check_logprob_volume,
    flag,
    guided_field,
    prompt_only,
    to_sampling_params,
)
from pdserve.services.gateway.parse import RequestParser
from pdserve.services.gateway.responses import OpenAIForm
from pdserve.services.gateway.responses_api.call import ResponsesCall
from pdserve.services.gateway.responses_api.store import ResponseStore
from pdserve.services.gateway.schema import ActiveRequest, GenerateCall
from pdserve.services.gateway.stages import kv_moved
from pdserve.services.gateway.tools.base import ToolCallParser
from pdserve.services.gateway.tools.output import ToolOutput
from pdserve.services.gateway.tools.registry import pick
from pdserve.services.gateway.tools.request import ToolRequest, tool_request
from pdserve.services.redis_conn import NO_AUTH, RedisAuth

log = logging.getLogger("pdserve.gateway")


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
    metrics_compat: str | None = None  # "vllm": also the vLLM-named aliases (docs/metrics.md)
    # internal security (docs/services.md, Trust model): Redis AUTH/TLS, and the registry HMAC key
    redis_auth: RedisAuth = NO_AUTH
    registry_key: bytes | None = None
    # the deployment's own components (the planner) read /metrics with the internal token; None: no such reader
    internal_token: str | None = None
    tool_call_parser: str | None = None  # the model's tool call format; None: detected from its chat template
    default_max_tokens: int | None = None  # a body without max_tokens: at most this many (None: the context left)
    max_logprob_entries: int = DEFAULT_MAX_LOGPROB_ENTRIES  # an answer's log-prob values at most (params.py)
    migration_limit: int = 2  # moves per request after its worker died mid-stream (gateway/migration.py)
    require_disagg: bool = False  # refuse (503) what the router would prefill on the decoding worker (path.py)
    grammar_limits: GrammarLimits = field(default_factory=GrammarLimits)  # guided output (grammar_limits.py)
    # browsers (origin.py): the address the gateway listens on (None: not its own listener, no Host check), the
    # Host names and the CORS origins allowed besides
    host: str | None = None
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()


def debug_options(headers) -> set[str]:
    """`x-pdserve-debug: route, stage-times`: what the client asks to see of the request's internals (each is
    honoured only for a tenant with the matching permission, tenants.py)."""
    return {x.strip().lower() for x in (headers.get("x-pdserve-debug") or "").split(",") if x.strip()}


def echo_texts(prompt, prompts: list[list[int]], tok: Tokenizer) -> list[str]:
    """What `echo` prepends to each prompt's choices: the prompt as the client wrote it, or its token ids
    decoded."""
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    return [tok.decode(ids) for ids in prompts]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("pdserve")
    except PackageNotFoundError:
        return "0"


def pick_tool_parser(name: str | None, tok: Tokenizer) -> ToolCallParser:
    """`--tool-call-parser`, else the format the chat template (its tool-use variant) writes."""
    try:
        template = tok.template_for(tools=[]) if tok.chat_templates else None
    except ValueError:  # several templates, none the default: detection looks at none of them
        template = None
    return pick(name, template)


def tool_output(treq: ToolRequest, parser: ToolCallParser, params) -> ToolOutput | None:
    """How the answer is read for calls (None for `tool_choice: none`: plain text); `required` and a named
    function constrain the sampling to the parser's call syntax, the arguments to the function's schema."""
    if treq.choice == "none":
        return None
    if treq.constrained and params.guided is not None:
        raise APIError(400, "invalid parameter 'tool_choice': a required or named tool choice cannot be "
                            "combined with response_format or guided_* (both constrain the output)",
                       param="tool_choice", code="invalid_parameter")
    if not parser.skip_special_tokens:
        params.skip_special_tokens = False  # the call marker is a special token: the parser must see it
    if treq.named is not None:  # the call is begun in the prompt (tools/output.py): only its arguments are sampled
        params.guided = GuidedSpec(json_schema=json.dumps(treq.allowed()[0].get("parameters") or {"type": "object"}))
        return ToolOutput(parser, False, parser.forced_call(treq.named))
    if treq.constrained:
        params.guided = parser.constraint(treq.allowed(), treq.parallel)
    return ToolOutput(parser, treq.parallel)


def _error_response(e: BaseException) -> JSONResponse:
    """An error as the HTTP client sees it (errors.reply_for: details stay in the log, under the request id)."""
    return _reply(reply_for(e))


def _reply(r: ErrorReply) -> JSONResponse:
    return JSONResponse(r.body(), status_code=r.status, headers=r.headers or None)


class _Abandon:
    """The end of a response that did not complete: `RequestHandler.cancel`, once, however many of the paths
    that notice call it (the body's `finally`, the response's, a disconnect poll)."""

    def __init__(self, handler: RequestHandler, st: ActiveRequest, reason: str = "client disconnected"):
        self.handler, self.st, self.reason = handler, st, reason
        self.body = None
        self.called = False

    def __call__(self) -> None:
        if not self.called:
            self.called = True
            self.handler.cancel(self.st, self.st.rec, self.reason, *([self.body] if self.body is not None else []))


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


@dataclass
class Gateway:
    """One gateway's parts, built once by `create_gateway`: the HTTP app, and what the gRPC front door, the metrics
    port and shutdown (server.py) use besides it."""
    app: FastAPI
    config: GatewayConfig
    dispatcher: Dispatcher
    tokenizer: Tokenizer  # the `tokenizers` library and the torch-free chat template
    lifecycle: RequestLifecycle
    parser: RequestParser  # parse.py: strict, 400 naming the field
    handler: RequestHandler  # the gRPC front door serves through the same one
    tool_parser: ToolCallParser  # tools/registry.py
    metrics: CollectorRegistry  # what /metrics and --metrics-port serve
    vocab: int
    max_len: int


def create_gateway(cfg: GatewayConfig, dispatcher: Dispatcher | None = None) -> Gateway:
    model_dir = resolve_model_dir(cfg.model)
    tok = Tokenizer(model_dir)
    limits = serving_limits(model_dir)  # config.json without torch: the gateway never imports the engine
    disp = dispatcher or Dispatcher(cfg.router_address, cfg.served_model_name, migration_limit=cfg.migration_limit,
                                     require_disagg=cfg.require_disagg)
    app = FastAPI(title="pdserve gateway", **fastapi_options())
    # openapi.py: the real request schemas, with this checkpoint's vocabulary and context
    app.openapi = lambda: openapi.document("pdserve gateway", _version(), limits.vocab_size, limits.max_model_len,
                                          cfg.served_model_name)
    if cfg.allowed_origins:  # inside BrowserGuard: a preflight from a foreign Host is refused like any request
        app.add_middleware(CORSMiddleware, allow_origins=list(cfg.allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["*"], expose_headers=["x-request-id"])
    app.add_middleware(BrowserGuard, hosts=allowed_hosts(cfg.host, cfg.allowed_hosts))
    app.add_middleware(HttpGuard, max_header_bytes=cfg.max_header_bytes)
    registry = http_metrics.install(app, cfg.served_model_name, cfg.metrics_compat)  # outermost: counts HttpGuard's
    life = build_lifecycle(cfg)
    g = Gateway(app, cfg, disp, tok, life, RequestParser(tok, limits.vocab_size, limits.max_model_len,
                                                         cfg.served_model_name),
                RequestHandler(life, disp, limits.max_model_len), pick_tool_parser(cfg.tool_call_parser, tok),
                registry, limits.vocab_size, limits.max_model_len)
    _error_handlers(app)
    _generation_routes(g)
    _info_routes(g)
    tokenize.install(app, life.gate, g.parser, limits.max_model_len)
    return g


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return _error_response(exc)

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


def _generation_routes(g: Gateway) -> None:
    """/v1/completions, /v1/chat/completions, and /v1/responses (a chat completion in the Responses API's
    form, responses_api/)."""
    @g.app.post("/v1/completions")
    async def completions(request: Request):
        return await _endpoint(g, request, chat=False)

    @g.app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _endpoint(g, request, chat=True)

    redis = g.lifecycle.gate.redis
    store = ResponseStore(redis, g.config.served_model_name) if redis is not None else None

    @g.app.post("/v1/responses")
    async def responses_create(request: Request):
        return await _endpoint(g, request, chat=True, api=ResponsesCall(g.config.served_model_name, store))


async def _parse_call(g: Gateway, request: Request, raw: bytes, chat: bool, form: OpenAIForm,
                      api: ResponsesCall | None = None) -> GenerateCall:
    """The body -> a checked GenerateCall (tokenized off the loop); `form` learns how the answer is presented.
    With `api`, the body is a Responses one, checked and translated into the chat body it means first."""
    cfg, parser, tok, max_len = g.config, g.parser, g.tokenizer, g.max_len
    body = parser.body(raw, chat) if api is None else parser.envelope(await api.chat_body(parser.decode(raw)), chat)
    debug = debug_options(request.headers)
    params = to_sampling_params(body, chat=chat, vocab_size=g.vocab)
    treq = tool_request(body) if chat else None
    if treq is not None:
        form.tools = tool_output(treq, g.tool_parser, params)
    check_guided(params, cfg.grammar_limits, guided_field(body, treq is not None and treq.constrained))
    forced = form.tools.forced[0] if form.tools is not None and form.tools.forced else ""
    prompts = [await parser.chat_prompt(body, treq.tools if treq else None, forced)] if chat \
        else await parser.completion_prompts(body)
    parser.check_room(prompts, params.max_tokens, body)
    if params.max_tokens is None and cfg.default_max_tokens is not None:
        # a bounded answer, and a bounded KV reservation while the tenant's predictor is cold
        params.max_tokens = max(1, min(cfg.default_max_tokens, max_len - max(len(p) for p in prompts)))
    check_logprob_volume(body, chat, prompts, params, prompt_only(body), max_len, cfg.max_logprob_entries)
    form.return_token_ids = bool(body.get("return_token_ids", False))
    if not chat and body.get("echo") is True:
        form.echo_prompts = echo_texts(body["prompt"], prompts, tok)
    form.include_usage = bool((body.get("stream_options") or {}).get("include_usage", False))
    return GenerateCall("chatcmpl" if chat else "cmpl", prompts, params, timeout_s=body.get("timeout"),
                        allow_degrade=body.get("allow_degrade", True) is not False,
                        streamed=bool(body.get("stream", False)),
                        debug_route="route" in debug,
                        stage_times="stage-times" in debug or flag(body, "return_stage_times"),
                        prompt_only=prompt_only(body),
                        priority=_num(body, "priority", int, None, 0, MAX_PRIORITY))


async def _endpoint(g: Gateway, request: Request, chat: bool, api: ResponsesCall | None = None):
    """One request, whichever form: with `api`, a Responses request whose answer it rewrites."""
    handler, life = g.handler, g.lifecycle
    rec = handler.new_record()
    form = OpenAIForm(g.config.served_model_name, chat, tokenizer=g.tokenizer)
    if api is not None:
        api.rec = rec  # its tenant scopes the stored responses
    try:
        raw = await life.gate.read_body(request)  # stage one starts before parsing or tokenizing
        parse = lambda: _parse_call(g, request, raw, chat, form, api)  # noqa: E731
        st = await handler.open(rec, request.headers, api.renaming(parse) if api is not None else parse)
    except Exception as e:  # noqa: BLE001 - every refusal is a typed reply (errors.reply_for)
        return _reply(await handler.fail(rec, e))
    except BaseException as e:  # cancelled while admitted or waiting for the first message
        await handler.fail(rec, e)
        raise
    abandon = _Abandon(handler, st)
    if st.call.streamed:
        abandon.body = responses.stream(handler, st, form)
        if api is not None:
            abandon.body = api.stream(abandon.body, st)
        return _OwnedStream(abandon.body, abandon, media_type="text/event-stream",
                            headers={"Cache-Control": "no-cache", **st.headers})
    answer = responses.collect(handler, st, form)
    task = asyncio.create_task(api.collect(answer) if api is not None else answer)
    # a non-streaming client that disconnects must not keep the workers busy
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if not done and await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            abandon()
            return Response(status_code=499)
    try:
        out = task.result()
    except Exception as e:  # noqa: BLE001
        return _reply(await handler.fail(rec, e))
    kv = kv_moved(st.traces)  # known once the answer is whole (a stream's header went out before the pull)
    return Response(out, media_type="application/json", headers={**st.headers, **(kv.headers() if kv else {})})


def _info_routes(g: Gateway) -> None:
    """/v1/models, /health, /status, /metrics."""
    app, cfg, disp, life = g.app, g.config, g.dispatcher, g.lifecycle

    def _model_card() -> dict:
        return {"id": cfg.served_model_name, "object": "model", "created": 0, "owned_by": "pdserve",
                "root": cfg.model, "parent": None, "max_model_len": g.max_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != cfg.served_model_name:
            raise APIError(404, f"The model '{model_id}' does not exist", "invalid_request_error", "model",
                           "model_not_found")
        return _model_card()

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

    @app.get("/status")
    async def status(request: Request):
        # `pdserve status --url` (docs/planner.md): worker addresses and load are operator information, so the
        # same permission as /metrics
        tenant = life.gate.tenants.authenticate(IngressGate.api_key(request.headers))
        if tenant is None or not tenant.can("metrics"):
            return _error_response(APIError(401 if tenant is None else 403, "this API key may not read the status",
                                            "authentication_error" if tenant is None else "permission_error"))
        from pdserve.services.status import gateway_status
        try:
            body = await gateway_status(disp, life.gate.redis, cfg.served_model_name, cfg.registry_key)
        except grpc.aio.AioRpcError as e:
            return JSONResponse({"status": "unavailable", "reason": f"router: {e.code().name}"}, status_code=503)
        return JSONResponse(body)

    @app.get("/metrics")
    async def metrics(request: Request):
        refused = _metrics_refusal(cfg.internal_token, life.gate.tenants, IngressGate.api_key(request.headers))
        if refused is not None:
            return refused
        return PlainTextResponse(generate_latest(g.metrics).decode(), media_type=CONTENT_TYPE_LATEST)


def _metrics_refusal(internal_token: str | None, tenants, key: str | None) -> Response | None:
    """/metrics on the API port lists every tenant's name and counts: only for a key with the `metrics`
    permission, or the internal token, whose holder can already register a worker (docs/admission.md, "Trust
    model"). None: allowed. A scraper inside the cluster can use --metrics-port instead."""
    if internal_token and key and hmac.compare_digest(key.encode(), internal_token.encode()):
        return None
    tenant = tenants.authenticate(key)
    if tenant is None:
        return _error_response(APIError(401, "missing or invalid API key", "authentication_error",
                                        code="invalid_api_key"))
    if not tenant.can("metrics"):
        return _error_response(APIError(403, "this API key may not read metrics", "permission_error",
                                        code="permission_denied"))
    return None
