"""Logs and traces across real processes (docs/observability.md).

Deployment A: `pdserve up --mode disagg --log-format json` with OTEL_EXPORTER_OTLP_ENDPOINT at a real OTLP/HTTP
receiver in this test (decoded with opentelemetry-proto, not with pdserve's code). Deployment B: colocated, text
logs, no OTEL_* at all. The client's `x-request-id` must come back in the response header and be on the JSON
lines of the gateway, the router and both workers; an unacceptable one is replaced, not refused; spans of the
gateway and the workers share one trace, linked by `traceparent`, and a client's trace id is kept.
"""
from __future__ import annotations

import asyncio
import gzip
import json
import os
import re
import secrets
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.services.convert import params_to_pb
from pdserve.services.grpc_util import channel
from pdserve.services.pb import gateway_pb2_grpc, worker_pb2
from pdserve.services.up_process import UpProcess
from tests.e2e.conftest import ROOT, served_as_ck, wait_until

SERVER, CLIENT = 2, 3  # opentelemetry.proto.trace.v1.Span.SpanKind
SANE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:+/=@-]{0,127}")


class OtlpReceiver:
    """A minimal OTLP/HTTP traces endpoint: POST /v1/traces with an ExportTraceServiceRequest (protobuf)."""

    def __init__(self):
        self.spans: list[tuple[dict, object]] = []  # (resource attributes, Span)
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                ok = self.path == "/v1/traces" and self.headers.get("Content-Type") == "application/x-protobuf"
                if ok:
                    req = ExportTraceServiceRequest.FromString(body)
                    with receiver.lock:
                        for rs in req.resource_spans:
                            res = {kv.key: kv.value.string_value for kv in rs.resource.attributes}
                            for ss in rs.scope_spans:
                                receiver.spans.extend((res, s) for s in ss.spans)
                self.send_response(200 if ok else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def trace(self, trace_id: bytes) -> list[tuple[dict, object]]:
        with self.lock:
            return [(r, s) for r, s in self.spans if s.trace_id == trace_id]

    def close(self):
        self.server.shutdown()


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PDSERVE_"))}
    env.update(PYTHONPATH=str(ROOT), PDSERVE_LOG_LEVEL="INFO", **extra)
    return env


@pytest.fixture(scope="module")
def otlp():
    r = OtlpReceiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def up_json(tiny_llama, tmp_path_factory, otlp):
    model, _ = served_as_ck(tiny_llama, tmp_path_factory, "")
    env = _env(OTEL_EXPORTER_OTLP_ENDPOINT=otlp.url, OTEL_BSP_SCHEDULE_DELAY="100")
    d = UpProcess(["--model", str(model), "--num-gpu-blocks", "128", "--mode", "disagg", "--log-format", "json"],
                  env, 120)
    yield d
    assert d.stop() == 0


@pytest.fixture(scope="module")
def up_text(tiny_llama, tmp_path_factory):
    model, _ = served_as_ck(tiny_llama, tmp_path_factory, "")
    d = UpProcess(["--model", str(model), "--num-gpu-blocks", "128", "--mode", "colocated"], _env(), 120)
    yield d
    assert d.stop() == 0


def _complete(up, headers: dict, max_tokens: int = 4) -> httpx.Response:
    r = httpx.post(up.base_url + "/v1/completions", headers=headers, timeout=30,
                   json={"model": "ck", "prompt": "the quick brown fox", "max_tokens": max_tokens,
                         "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r


def _json_lines(up) -> list[dict]:
    out = []
    for line in list(up.lines):
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def _with_id(up, rid: str) -> list[dict]:
    return [x for x in _json_lines(up) if x.get("request_id") == rid]


def _seen_everywhere(up, rid: str) -> bool:
    where = {(x["process"], x.get("worker_role")) for x in _with_id(up, rid)}
    return {("gateway", None), ("router", None), ("worker", "prefill"), ("worker", "decode")} <= where


def _access_line(up, rid: str) -> bool:
    # logged once the response is sent, so it may trail the client's read by a moment
    return any(x["logger"] == "pdserve.access" and "POST /v1/completions 200" in x["message"] for x in _with_id(up, rid))


def test_json_lines_carry_the_client_request_id_on_every_process(up_json):
    rid = "abc-123"
    r = _complete(up_json, {"x-request-id": rid})
    assert r.headers["x-request-id"] == rid
    # the workers log the RPCs they served for it; the decode worker's is a server stream, logged when it ends,
    # which can trail the client's answer on a loaded machine (its other lines are out already)
    want = {("prefill", "/pdserve.v1.Worker/Prefill"), ("decode", "/pdserve.v1.Worker/GenerateFromPrefill"),
            (None, "/pdserve.v1.Router/Route")}

    def rpcs() -> set:
        return {(x.get("worker_role"), x["message"].split()[0]) for x in _with_id(up_json, rid)
                if x["logger"] == "pdserve.rpc"}

    assert wait_until(lambda: _seen_everywhere(up_json, rid) and _access_line(up_json, rid) and want <= rpcs(), 10), \
        (rpcs(), _json_lines(up_json)[-30:])
    lines = _with_id(up_json, rid)
    for x in lines:  # the documented fields, on every line
        assert {"ts", "level", "logger", "message", "process", "pid"} <= x.keys(), x
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", x["ts"]), x
    # tracing is on here: the request's lines in every process name one trace
    assert len({x.get("trace_id") for x in lines}) == 1 and lines[0].get("trace_id"), lines


@pytest.mark.parametrize("bad", ["has spaces", "x" * 129, "semi;colon", "-leading-dash", "quote\"d"])
def test_unacceptable_request_id_is_replaced_not_refused(up_json, bad):
    r = _complete(up_json, {"x-request-id": bad})
    new = r.headers["x-request-id"]
    assert new != bad and SANE_ID.fullmatch(new), new
    assert wait_until(lambda: _seen_everywhere(up_json, new), 10)
    assert not any(bad in line for line in up_json.lines if "x-request-id" not in line)


def _grpc_generate(up, md: tuple) -> tuple[dict, list]:
    async def main():
        stub = gateway_pb2_grpc.GatewayStub(channel(f"127.0.0.1:{up.process('gateway')['grpc_port']}"))
        call = stub.Generate(worker_pb2.GenerateRequest(
            prompt_token_ids=list(range(30, 60)),
            params=params_to_pb(SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))), metadata=md,
            timeout=30)
        msgs = [m async for m in call]
        return dict(await call.initial_metadata()), dict(await call.trailing_metadata()), msgs
    initial, trailing, msgs = asyncio.run(main())
    assert msgs and msgs[-1].finished
    return initial, trailing


def test_grpc_front_door_echoes_and_propagates_the_request_id(up_json):
    initial, trailing = _grpc_generate(up_json, (("x-request-id", "grpc-id-7"),))
    assert initial["x-request-id"] == "grpc-id-7" and trailing["x-request-id"] == "grpc-id-7"
    assert wait_until(lambda: _seen_everywhere(up_json, "grpc-id-7"), 10)
    initial, _ = _grpc_generate(up_json, (("x-request-id", "not valid!"),))
    assert initial["x-request-id"] != "not valid!" and SANE_ID.fullmatch(initial["x-request-id"])
    assert wait_until(lambda: _seen_everywhere(up_json, initial["x-request-id"]), 10)
    initial, _ = _grpc_generate(up_json, ())  # none given: one is made, and echoed
    assert SANE_ID.fullmatch(initial["x-request-id"])


def _process(res: dict) -> str:
    return res.get("pdserve.process", "") + ("/" + res["pdserve.worker_role"] if "pdserve.worker_role" in res else "")


def _complete_trace(spans) -> bool:
    """The request's main spans are in, and every span's parent too: each process exports in its own batches, so a
    worker's span can arrive before the gateway's client span above it (seen under load: ReleaseKV's)."""
    names = {(_process(r), s.name) for r, s in spans}
    ids = {s.span_id for _, s in spans}
    if not all(s.parent_span_id in ids for _, s in spans if s.name != "POST /v1/completions"):
        return False
    return {("worker/prefill", "pdserve.v1.Worker/Prefill"), ("worker/decode", "pdserve.v1.Worker/GenerateFromPrefill"),
            ("gateway", "gateway.decode"), ("worker/decode", "engine.decode")} <= names


def _summary(spans) -> list[str]:
    return [f"{_process(r)} {s.name} kind={s.kind} id={s.span_id.hex()} parent={s.parent_span_id.hex()} "
            f"{ {a.key: a.value.string_value or a.value.int_value for a in s.attributes} }" for r, s in spans]


def _check_trace(spans, client_parent: bytes | None) -> None:
    by_id = {s.span_id: (r, s) for r, s in spans}
    assert len(by_id) == len(spans)
    roots = [(r, s) for r, s in spans if s.name == "POST /v1/completions"]
    assert len(roots) == 1, "\n".join(_summary(spans))
    res, http = roots[0]
    assert _process(res) == "gateway" and http.kind == SERVER and res["service.name"] == "pdserve-gateway"
    assert http.parent_span_id == (client_parent or b"")
    # every other span hangs off this one, within this trace
    for r, s in spans:
        if s is not http:
            assert s.parent_span_id in by_id, (s.name, _process(r))
    # the gateway's stages: children of the HTTP span, in order, inside it
    stages = {s.name: s for r, s in spans if s.name.startswith("gateway.")}
    assert {"gateway.admission", "gateway.route", "gateway.prefill", "gateway.decode"} <= stages.keys(), stages.keys()
    for s in stages.values():
        assert s.parent_span_id == http.span_id
        assert http.start_time_unix_nano <= s.start_time_unix_nano <= s.end_time_unix_nano <= http.end_time_unix_nano
    assert stages["gateway.admission"].end_time_unix_nano <= stages["gateway.route"].end_time_unix_nano \
        <= stages["gateway.decode"].end_time_unix_nano
    # each worker's server span is the child of the gateway's client span for that call (traceparent over gRPC)
    for want in ("pdserve.v1.Worker/Prefill", "pdserve.v1.Worker/GenerateFromPrefill", "pdserve.v1.Router/Route"):
        server = [(r, s) for r, s in spans if s.name == want and s.kind == SERVER]
        assert len(server) == 1, want
        pr, parent = by_id[server[0][1].parent_span_id]
        assert _process(pr) == "gateway" and parent.kind == CLIENT and parent.name == "/" + want
        assert parent.parent_span_id == http.span_id
    # the engines' stages: children of their worker's server span
    for role, rpc, want in (("worker/prefill", "pdserve.v1.Worker/Prefill", {"engine.queue", "engine.prefill"}),
                            ("worker/decode", "pdserve.v1.Worker/GenerateFromPrefill",
                             {"engine.queue", "engine.kv_transfer", "engine.decode"})):
        srv = next(s for r, s in spans if s.name == rpc and s.kind == SERVER)
        eng = [s for r, s in spans if _process(r) == role and s.name.startswith("engine.")]
        assert want <= {s.name for s in eng}, (role, [s.name for s in eng])
        for s in eng:
            assert s.parent_span_id == srv.span_id
            assert s.start_time_unix_nano <= s.end_time_unix_nano
    kv = [s for r, s in spans if s.name == "engine.kv_transfer"]
    assert len(kv) == 1  # the decode worker's pull


def test_spans_of_gateway_and_workers_share_the_client_trace(up_json, otlp):
    trace_id, parent = secrets.token_bytes(16), secrets.token_bytes(8)
    _complete(up_json, {"traceparent": f"00-{trace_id.hex()}-{parent.hex()}-01", "x-request-id": "traced-1"})
    assert wait_until(lambda: _complete_trace(otlp.trace(trace_id)), 15), \
        sorted((_process(r), s.name) for r, s in otlp.trace(trace_id))
    _check_trace(otlp.trace(trace_id), parent)
    # the log lines of the request name the same trace
    assert {x.get("trace_id") for x in _with_id(up_json, "traced-1")} == {trace_id.hex()}


def test_a_request_without_traceparent_starts_its_own_trace(up_json, otlp):
    rid = "untraced-2"
    _complete(up_json, {"x-request-id": rid})
    assert wait_until(lambda: _seen_everywhere(up_json, rid), 10)
    trace_hex = _with_id(up_json, rid)[0]["trace_id"]
    trace_id = bytes.fromhex(trace_hex)
    assert wait_until(lambda: _complete_trace(otlp.trace(trace_id)), 15)
    _check_trace(otlp.trace(trace_id), None)


def test_text_logs_without_tracing(up_text):
    rid = "text-id-9"
    r = _complete(up_text, {"x-request-id": rid})
    assert r.headers["x-request-id"] == rid

    def tagged(process: str) -> list[str]:
        return [line for line in up_text.lines if re.match(rf"\S+ \S+ {process}\[\d+\] INFO \S+ \[{rid}\]: ", line)]

    assert wait_until(lambda: tagged("worker") and tagged("gateway") and tagged("router"), 10), up_text.lines[-20:]
    assert any("/pdserve.v1.Worker/Generate OK" in line for line in tagged("worker"))
    assert not any("trace=" in line for line in up_text.lines)  # no OTEL_*: no tracing
    assert not any(line.startswith("{") for line in up_text.lines)
