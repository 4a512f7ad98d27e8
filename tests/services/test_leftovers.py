"""The fault matrix's readings without a deployment: what a case left behind (services/leftovers.py: workers' /metrics
and the reservation keys in Redis) and the usage records counted from gateway log lines (bench/chaos.py)."""
from __future__ import annotations

import http.server
import threading

import pytest

from pdserve.bench.chaos import billing, records
from pdserve.services.leftovers import Leftovers, metric_sum, read_leftovers, settle

PAGE = """# HELP pdserve_kv_blocks_in_use x
pdserve_kv_blocks_in_use{model="m",role="decode"} 3.0
pdserve_kv_blocks_pinned{model="m",role="decode"} 2.0
pdserve_kv_blocks_in_use_total 100.0
"""


@pytest.fixture
def metrics_server():
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = PAGE.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/metrics"
    srv.shutdown()
    srv.server_close()


class FakeRedis:
    def __init__(self, z: dict[str, int], h: dict[str, int]):
        self.z, self.h = z, h

    def zcard(self, key: str) -> int:
        return self.z.get(key, 0)

    def hlen(self, key: str) -> int:
        return self.h.get(key, 0)


def test_metric_sum_takes_every_labelled_sample_of_that_name_only():
    assert metric_sum(PAGE, "pdserve_kv_blocks_in_use") == 3.0  # not the `_total` family sharing its prefix
    assert metric_sum(PAGE + 'pdserve_kv_blocks_in_use{role="prefill"} 4\n', "pdserve_kv_blocks_in_use") == 7.0


def test_read_leftovers_sums_workers_and_reads_the_ledger_keys(metrics_server):
    r = FakeRedis({"pdserve:m:reservations": 2, "pdserve:other:reservations": 9}, {"pdserve:m:reservation_blocks": 1})
    left = read_leftovers({"a": metrics_server, "b": metrics_server}, lambda: r, "m")
    assert (left.blocks, left.pinned, left.reservations) == (6, 4, 3)
    assert left.per_worker == {"a": (3, 2), "b": (3, 2)} and not left.clean


def test_read_leftovers_says_none_for_what_it_could_not_read(metrics_server):
    def no_redis():
        raise ConnectionError("down")

    left = read_leftovers({"a": metrics_server, "gone": "http://127.0.0.1:9/metrics"}, no_redis, "m")
    assert (left.blocks, left.pinned, left.reservations) == (None, None, None) and not left.clean
    assert read_leftovers({}, lambda: FakeRedis({}, {}), "m").clean


def test_settle_reads_until_clean_or_the_timeout():
    seq = iter([Leftovers(2, 0, 1), Leftovers(1, 0, 0), Leftovers(0, 0, 0)])
    left, took = settle(lambda: next(seq), 5, every=0.01)
    assert left.clean and took is not None and took < 5
    left, took = settle(lambda: Leftovers(0, 1, 0), 0.05, every=0.01)
    assert left.pinned == 1 and took is None


def test_records_and_billing_count_usage_lines_per_request_id():
    lines = [
        'gateway: 2026 INFO pdserve.billing [chaos-x-1]: {"request_id": "cmpl-a", "state": "FINISHED"}',
        '... INFO pdserve.billing [chaos-x-2]: {"request_id": "cmpl-b"}',
        '... INFO pdserve.billing [chaos-x-2]: {"request_id": "cmpl-b2"}',
        '... INFO pdserve.billing [other-3]: {"request_id": "cmpl-c"}',
        '... INFO pdserve.access [chaos-x-4]: POST /v1/completions 200',
    ]
    recs = records(lines, "chaos-x-")
    assert recs["chaos-x-1"] == [{"request_id": "cmpl-a", "state": "FINISHED"}]
    assert billing(lines, "chaos-x-") == {"chaos-x-1": 1, "chaos-x-2": 2}
