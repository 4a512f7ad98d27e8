"""pdserve/services/tracing.py: when the OTEL_* variables turn tracing on, that nothing of the SDK loads when they
don't, and the stage spans' names and times (checked against the timestamps they come from)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from pdserve.services import tracing
from pdserve.services.gateway.stages import StageTrace, stage_times

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("env,on", [
    ({}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, True),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, True),
    ({"OTEL_TRACES_EXPORTER": "console"}, True),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, False),
    ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, False),
    ({"OTEL_SERVICE_NAME": "x"}, False),
])
def test_configured(env, on):
    assert tracing.configured(env) is on


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    import os
    base = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    return subprocess.run([sys.executable, "-c", code], env={**base, "PYTHONPATH": str(ROOT), **env},
                          capture_output=True, text=True, timeout=120, check=False)


def test_off_loads_no_sdk_and_on_does():
    code = ("import sys; from pdserve.services import tracing, logs, grpc_context; import logging; "
            "logs.setup('router', 'json'); print(tracing.setup('router')); logging.getLogger('x').warning('w'); "
            "print(sorted({m.split('.')[1] for m in sys.modules if m.startswith('opentelemetry.')}))")
    off = _run(code)
    assert off.returncode == 0, off.stderr
    assert off.stdout.splitlines()[0] == "False"
    assert "sdk" not in off.stdout and "exporter" not in off.stdout
    on = _run(code, OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9")
    assert on.returncode == 0, on.stderr
    assert on.stdout.splitlines()[0] == "True" and "'sdk'" in on.stdout and "'exporter'" in on.stdout


def test_unsupported_protocol_is_one_clear_error():
    r = _run("from pdserve.services import tracing; tracing.setup('router')",
             OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9", OTEL_EXPORTER_OTLP_PROTOCOL="grpc")
    assert r.returncode != 0 and "http/protobuf" in r.stderr


@pytest.fixture
def spans(monkeypatch):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("test"))
    monkeypatch.setattr(tracing, "_KIND", SpanKind)
    return exporter


class _Times:
    def __init__(self, **kw):
        self.kv_bytes = 0  # StageTimes' field the spans do not use
        self.__dict__.update(kw)


def test_gateway_stage_spans_follow_stage_times(spans):
    t = StageTrace()
    t.on_route("disagg")
    t.routed = 100.010
    t.on_prefill(_Times(arrival=100.012, first_scheduled=100.015, first_token=100.030, finished=0,
                        kv_transfer_start=0, kv_transfer_end=0))
    t.on_stream(_Times(arrival=100.032, first_scheduled=0, first_token=0, finished=100.090,
                       kv_transfer_start=100.034, kv_transfer_end=100.040))
    t.on_emit(100.031)
    t.on_emit(100.095)
    handle = tracing.start_server_span("POST /v1/completions", {})
    tracing.at_request_end(lambda: tracing.gateway_stage_spans(stage_times(100.0, 100.004, t)))
    tracing.end_server_span(handle)
    def ns(x: float) -> int:
        return int(x * 1e9)

    got = {s.name: (s.start_time, s.end_time) for s in spans.get_finished_spans()}
    want = {"gateway.admission": (100.0, 100.004), "gateway.route": (100.004, 100.010),
            "gateway.dispatch": (100.010, 100.012), "gateway.queue": (100.012, 100.015),
            "gateway.prefill": (100.015, 100.030), "gateway.handoff": (100.030, 100.034),
            "gateway.kv_transfer": (100.034, 100.040), "gateway.first_emit": (100.030, 100.031),
            "gateway.decode": (100.031, 100.095)}
    for name, (a, b) in want.items():
        assert got[name] == (ns(a), ns(b)), name
    finished = spans.get_finished_spans()
    root = next(s for s in finished if s.name == "POST /v1/completions")
    assert root.kind == SpanKind.SERVER and root.parent is None
    assert all(s.parent.span_id == root.context.span_id for s in finished if s is not root)


def test_engine_stage_spans_skip_unknown_and_reversed(spans):
    n = tracing.stage_spans("engine", {"arrival": 5.0, "first_scheduled": 5.5, "first_token": 5.25, "finished": 6.0,
                                       "kv_transfer_start": 0.0, "kv_transfer_end": 5.1}, tracing.ENGINE_STAGES)
    names = sorted(s.name for s in spans.get_finished_spans())
    assert n == 2 and names == ["engine.decode", "engine.queue"]  # prefill reversed, kv_transfer start unknown


def test_client_span_injects_a_traceparent_naming_itself(spans):
    handle = tracing.start_server_span("srv", {"traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"})
    span, pairs = tracing.start_client_span("/svc/M")
    md = dict(pairs)
    span.end()
    tracing.end_server_span(handle)
    ctx = span.get_span_context()
    assert md["traceparent"] == f"00-{'ab' * 16}-{ctx.span_id:016x}-01"
    assert tracing.current_ids() is None  # the server span is no longer current
