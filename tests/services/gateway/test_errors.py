"""How a request's end maps to its HTTP reply (gateway/errors.py reply_for)."""
from __future__ import annotations

from pdserve.services.gateway.errors import RequestFailed, reply_for
from pdserve.services.pb import common_pb2


def _failed(retryable: bool) -> RequestFailed:
    m = common_pb2.GenerateResponse(finished=True, state="FAILED", error="decode failed: no placement",
                                    retryable=retryable)
    return RequestFailed(m.state, m.error, m)


def test_no_decode_worker_left_is_a_503_not_a_500():
    """A decode host cut off after the prefill (tests/e2e/test_lab.py): nothing reached the client, the deployment
    has no worker to finish it. Before: 500 `failed`."""
    r = reply_for(_failed(retryable=True))
    assert (r.status, r.code, r.state) == (503, "no_workers", "FAILED") and r.headers["Retry-After"] == "1"


def test_a_failure_of_the_request_itself_stays_a_500():
    r = reply_for(_failed(retryable=False))
    assert (r.status, r.code) == (500, "failed")
    assert reply_for(RequestFailed("TIMED_OUT", "deadline")).status == 504
