"""Every body the gateway's own `/openapi.json` describes, and bodies it does not, are answered without a server
error: schemathesis generates requests from the live document in its positive mode (bodies
the schema accepts) and its negative mode (bodies it refuses), against a real `pdserve up` on the tiny model.

A 5xx is a defect, with the two answers that are the request's own doing or the load's, never the gateway's: 504
`timeout` (the body's own `timeout` passed, e.g. `timeout: 1e-9`) and 503 with a typed error and a
`Retry-After`-style code (`no_capacity`, `deadline_unreachable`, `queue_full`, ...). A 500 or 502 is never
allowed, nor a dropped connection. In positive mode the share of bodies accepted is reported and held above
MIN_ACCEPTED: the document is the contract (what it calls valid, the server serves). Bounded: PDSERVE_SCHEMATHESIS_EXAMPLES examples per operation (default 30),
no shrinking, a fixed seed, so a CI run is a few tens of seconds.
"""
from __future__ import annotations

import os
from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

from tests.e2e.conftest import Up

STATUSES: list[int] = []  # the answers of the current test's examples
EXAMPLES = int(os.environ.get("PDSERVE_SCHEMATHESIS_EXAMPLES", "30"))
MIN_ACCEPTED = 0.5  # measured: ~0.6-0.7 of positive-mode bodies (before the schema followed the server: 6 of 3,224)
# what a 503/504 may say: the request's own deadline, or the load (docs/admission.md); never an internal error
LOAD_OR_DEADLINE = {"timeout", "no_capacity", "deadline_unreachable", "queue_full", "queue_deadline",
                    "no_workers", "overloaded"}


@pytest.fixture(scope="module")
def up(tiny_llama):
    u = Up(tiny_llama, "--mode", "colocated", "--workers", "1")
    yield u
    u.stop()


def _operations(up) -> list:
    s = schemathesis.openapi.from_url(up.base_url + "/openapi.json")
    return [r.ok() for r in s.get_all_operations()]


REFUSALS: Counter = Counter()  # the current test's 4xx answers, by the parameter they name


def _check(case) -> int:
    r = case.call(timeout=60)
    STATUSES.append(r.status_code)
    if 400 <= r.status_code < 500:
        err = r.json().get("error") or {}
        REFUSALS[(r.status_code, err.get("param"), (err.get("message") or "")[:70])] += 1
    if r.status_code < 500:
        return r.status_code
    err = r.json().get("error", {})  # a 5xx must still be a typed error body, not a traceback or a reset
    assert r.status_code in (503, 504) and err.get("code") in LOAD_OR_DEADLINE, \
        (r.status_code, r.text[:500], case.as_curl_command())
    return r.status_code


def test_the_document_has_the_generation_endpoints(up):
    labels = {op.label for op in _operations(up)}
    assert {"POST /v1/completions", "POST /v1/chat/completions", "POST /v1/responses"} <= labels, labels


# The hypothesis strategies of schemathesis, driven here (its pytest plugin does not run under pytest 9).
POS, NEG = GenerationMode.POSITIVE, GenerationMode.NEGATIVE
CASES = [("POST /v1/completions", POS), ("POST /v1/completions", NEG), ("POST /v1/chat/completions", POS),
         ("POST /v1/chat/completions", NEG), ("POST /v1/responses", POS), ("POST /v1/responses", NEG),
         ("GET /v1/models/{model_id}", POS), ("POST /tokenize", POS), ("POST /tokenize", NEG),
         ("POST /detokenize", POS)]  # the others take no input


@pytest.mark.parametrize("label,mode", CASES, ids=[f"{c[0]}-{c[1].value}" for c in CASES])
def test_no_generated_request_gets_a_server_error(up, label, mode):
    op = next((o for o in _operations(up) if o.label == label), None)
    assert op is not None, label
    calls = []

    @given(case=op.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def run(case):
        calls.append(1)
        _check(case)

    STATUSES.clear()
    REFUSALS.clear()
    run()
    print(label, mode.value, sorted(Counter(STATUSES).items()), REFUSALS.most_common(8))  # for the run's log
    assert calls  # the strategy produced requests: the property was checked, not skipped
    if mode is POS and label.startswith("POST /v1/"):
        # the document is the contract: what it calls valid the server serves (200), or refuses for what JSON
        # Schema cannot say (docs/api.md, "OpenAPI and models"); load answers (503/504) count as accepted
        share = sum(s == 200 or s >= 500 for s in STATUSES) / len(STATUSES)
        print(f"{label}: {share:.0%} of {len(STATUSES)} schema-valid bodies accepted")
        assert share >= MIN_ACCEPTED, (share, REFUSALS.most_common(5))
