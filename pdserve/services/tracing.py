"""OpenTelemetry tracing, on only when the standard `OTEL_*` variables ask for it (docs/observability.md).

Off (the default), nothing here imports OpenTelemetry and every helper is a check of one module global: the
request path pays nothing. On, each process exports its spans over OTLP/HTTP (protobuf) with a batch processor,
configured by the SDK's own variables (OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, _HEADERS, _TIMEOUT,
OTEL_BSP_*, OTEL_TRACES_SAMPLER, OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, OTEL_PROPAGATORS).

The spans of one request, across processes (W3C `traceparent`: HTTP header in, gRPC metadata between):

    gateway  POST /v1/completions              (SERVER; parent: the client's traceparent, if any)
               gateway.admission … gateway.decode   (the stage_times partition, stages.py)
               pdserve.v1.Router/Route         (CLIENT)
               pdserve.v1.Worker/Prefill       (CLIENT) ─┐
    worker       pdserve.v1.Worker/Prefill     (SERVER) ◄┘ parent via traceparent
                   engine.queue, engine.prefill, engine.decode, engine.kv_transfer (the worker's StageTimes)
"""
from __future__ import annotations

import contextvars
import os
import sys

_tracer = None  # an opentelemetry Tracer once setup() turned tracing on
_KIND = None  # opentelemetry.trace.SpanKind, imported with it

# Callbacks to run inside the HTTP request's span just before it ends (the gateway's stage spans need the
# request's complete record: the last emit is known only once the response is sent).
_at_end: contextvars.ContextVar[list | None] = contextvars.ContextVar("pdserve_trace_at_end", default=None)

# the gateway's stage_times partition: (span, start timestamp, end timestamp)
GATEWAY_STAGES = (("admission", "arrival", "admitted"), ("route", "admitted", "routed"),
                  ("dispatch", "routed", "worker_arrival"), ("queue", "worker_arrival", "first_scheduled"),
                  ("prefill", "first_scheduled", "first_token"), ("handoff", "first_token", "kv_transfer_start"),
                  ("kv_transfer", "kv_transfer_start", "kv_transfer_end"), ("decode", "first_emit", "last_emit"))
# a worker's StageTimes (common.proto)
ENGINE_STAGES = (("queue", "arrival", "first_scheduled"), ("prefill", "first_scheduled", "first_token"),
                 ("decode", "first_token", "finished"), ("kv_transfer", "kv_transfer_start", "kv_transfer_end"))


def configured(env=os.environ) -> bool:
    """Whether the OTEL_* variables ask for traces: an OTLP endpoint or an explicit traces exporter, and the SDK
    not disabled."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return False
    return bool(exporter or env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def _exporter(name: str):
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter
        return ConsoleSpanExporter(out=sys.stderr)
    if name != "otlp":
        raise ValueError(f"OTEL_TRACES_EXPORTER={name!r}: pdserve exports with otlp or console")
    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "http/protobuf")
    if protocol != "http/protobuf":
        raise ValueError(f"OTLP protocol {protocol!r}: pdserve exports traces with http/protobuf "
                         "(set OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf and the collector's HTTP port, 4318)")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    return OTLPSpanExporter()


def setup(process: str, worker_role: str | None = None) -> bool:
    """Turn tracing on for this process when configured(); returns whether it is on. The provider flushes its
    batch at interpreter exit (the servers return from asyncio.run after draining)."""
    global _tracer, _KIND
    if not configured():
        return False
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attrs = {"pdserve.process": process}
    if worker_role:
        attrs["pdserve.worker_role"] = worker_role
    if not os.environ.get("OTEL_SERVICE_NAME") and "service.name=" not in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", ""):
        attrs["service.name"] = f"pdserve-{process}"
    provider = TracerProvider(resource=Resource.create(attrs))
    for name in (os.environ.get("OTEL_TRACES_EXPORTER") or "otlp").split(","):
        provider.add_span_processor(BatchSpanProcessor(_exporter(name.strip().lower())))
    trace.set_tracer_provider(provider)
    _tracer = trace.get_tracer("pdserve")
    _KIND = trace.SpanKind
    return True


def enabled() -> bool:
    return _tracer is not None


def shutdown() -> None:
    """Flush and stop the exporter (also done at exit)."""
    if _tracer is not None:
        from opentelemetry import trace
        provider = trace.get_tracer_provider()
        if hasattr(provider, "shutdown"):
            provider.shutdown()


def current_ids() -> tuple[str, str] | None:
    """(trace id, span id) in hex of the span current here, when tracing is on and there is one."""
    if _tracer is None:
        return None
    from opentelemetry import trace
    sc = trace.get_current_span().get_span_context()
    if not sc.is_valid:
        return None
    return format(sc.trace_id, "032x"), format(sc.span_id, "016x")


# ---- spans --------------------------------------------------------------------------------------------------

def start_server_span(name: str, carrier: dict[str, str], attributes: dict | None = None):
    """A SERVER span whose parent is the caller's `traceparent` in `carrier` (if any), made current in this
    context (the task serving the request: its child tasks inherit it). Returns (span, token) or None; pass
    them to end_server_span. None when tracing is off."""
    if _tracer is None:
        return None
    from opentelemetry import context, propagate, trace
    span = _tracer.start_span(name, context=propagate.extract(carrier), kind=_KIND.SERVER, attributes=attributes)
    token = context.attach(trace.set_span_in_context(span))
    return span, token, _at_end.set([])


def end_server_span(handle, error: BaseException | None = None, failed: str | None = None) -> None:
    """End a span from start_server_span: `error` (an exception) or `failed` (a status text) marks it failed."""
    if handle is None:
        return
    from opentelemetry import context
    from opentelemetry.trace import Status, StatusCode
    span, token, end_token = handle
    try:
        for fn in _at_end.get() or ():
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - a span is never worth failing a request over
                span.record_exception(e)
        if error is not None:
            span.record_exception(error)
            span.set_status(Status(StatusCode.ERROR, type(error).__name__))
        elif failed:
            span.set_status(Status(StatusCode.ERROR, failed))
    finally:
        span.end()
        _at_end.reset(end_token)
        context.detach(token)


def at_request_end(fn) -> None:
    """Run `fn` inside the current request's server span just before it ends (no-op with tracing off)."""
    pending = _at_end.get()
    if pending is not None:
        pending.append(fn)


def start_client_span(name: str, attributes: dict | None = None):
    """A CLIENT span, child of the current one, and the metadata that makes the callee's span its child.
    Returns (span, [(key, value), ...]) or None with tracing off."""
    if _tracer is None:
        return None
    from opentelemetry import propagate, trace
    span = _tracer.start_span(name, kind=_KIND.CLIENT, attributes=attributes)
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return span, list(carrier.items())


def _ns(t: float) -> int:
    return int(t * 1e9)


def stage_spans(prefix: str, times, stages, attributes: dict | None = None) -> int:
    """Child spans of the current span, one per stage whose two timestamps are known (unix seconds; 0 or None =
    unknown), at those times. `times` is a dict or a message with the stage fields. Returns how many."""
    if _tracer is None:
        return 0
    get = times.get if isinstance(times, dict) else (lambda k: getattr(times, k, None))
    n = 0
    for name, a, b in stages:
        t0, t1 = get(a), get(b)
        if t0 and t1 and t1 >= t0:
            span = _tracer.start_span(f"{prefix}.{name}", start_time=_ns(t0), attributes=attributes)
            span.end(end_time=_ns(t1))
            n += 1
    return n


def gateway_stage_spans(st: dict) -> int:
    """The gateway's stage spans from one `usage.stage_times` object (stages.stage_times)."""
    first_emit_from = st.get("kv_transfer_end") if st.get("kv_on_ttft_path") else st.get("first_token")
    stages = [*GATEWAY_STAGES, ("first_emit", "first_emit_from", "first_emit")]
    return stage_spans("gateway", {**st, "first_emit_from": first_emit_from}, stages,
                       {"pdserve.mode": st.get("mode") or "", "pdserve.sub_request": st.get("sub_request") or 0})
