"""pdserve/services/metrics/exposition.py, vllm_compat.py and gateway/http_metrics.py in one process, against
hand-written expectations (the real-process checks are tests/e2e/test_metrics.py)."""
from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.services.gateway import http_metrics
from pdserve.services.metrics import exposition
from pdserve.services.metrics import gateway as G


def _samples(reg) -> dict[tuple, float]:
    text = generate_latest(reg).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if not s.name.endswith("_created")}


def test_constant_labels_and_aliases_with_vllm_label_names():
    role = CollectorRegistry()
    term = Counter("pdserve_requests_terminal_total", "t", ["state"], registry=role)
    running = Gauge("pdserve_num_running", "r", registry=role)
    term.labels("FINISHED").inc(3)
    term.labels("FAILED").inc(2)
    running.set(7)
    got = _samples(exposition.exposition(role, {"model": "m", "role": "decode"}, "vllm"))
    assert got[("pdserve_requests_terminal_total", (("model", "m"), ("role", "decode"), ("state", "FINISHED")))] == 3
    # request_success: the FINISHED sample only, its `state` label dropped, `model` renamed to `model_name`
    success = {k: v for k, v in got.items() if k[0] == "vllm:request_success_total"}
    assert success == {("vllm:request_success_total", (("model_name", "m"), ("role", "decode"))): 3}
    assert got[("vllm:num_requests_running", (("model_name", "m"), ("role", "decode")))] == 7
    # families the process does not have get no alias
    assert not any(k[0].startswith("vllm:kv_cache") for k in got)


def test_no_aliases_without_compat_and_unknown_compat_refused():
    role = CollectorRegistry()
    Gauge("pdserve_num_running", "r", registry=role).set(1)
    assert not any(k[0].startswith("vllm:") for k in _samples(exposition.exposition(role, {"model": "m"})))
    with pytest.raises(ValueError, match="sglang"):
        exposition.exposition(role, {"model": "m"}, "sglang")


def test_shared_families_only_once_per_process():
    got = _samples(exposition.exposition(CollectorRegistry(), {"model": "m"}))
    names = {k[0] for k in got}
    assert "process_cpu_seconds_total" in names and not any(n.startswith("pdserve_kv") for n in names)


def _count(endpoint: str, status: str) -> float:
    return G.HTTP_REQUESTS.labels(endpoint, status)._value.get()


def test_http_metrics_label_routes_by_template_and_status():
    app = FastAPI()
    registry = http_metrics.install(app, "m", None)

    @app.get("/v1/models/{model_id}")
    async def model(model_id: str):  # added after the middleware: still matched (the live route list)
        return {"id": model_id}

    c = TestClient(app)
    before = {k: _count(*k) for k in (("/v1/models/{model_id}", "200"), ("/v1/models/{model_id}", "405"),
                                       ("other", "404"))}
    for i in range(3):
        assert c.get(f"/v1/models/x{i}").status_code == 200
    assert c.post("/v1/models/x").status_code == 405
    assert c.get("/nope/123").status_code == 404
    assert _count("/v1/models/{model_id}", "200") - before[("/v1/models/{model_id}", "200")] == 3
    assert _count("/v1/models/{model_id}", "405") - before[("/v1/models/{model_id}", "405")] == 1
    assert _count("other", "404") - before[("other", "404")] == 1
    assert G.HTTP_IN_FLIGHT.labels("/v1/models/{model_id}")._value.get() == 0
    # what /metrics serves for this app carries the model label
    text = generate_latest(registry).decode()
    assert 'pdserve_http_requests_total{endpoint="other",model="m",status="404"}' in text
