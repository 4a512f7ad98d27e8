"""Hostile neighbours: a normal client's latency while each attack runs in turn against a real
disaggregated deployment (pdserve/bench/hostile.py drives both).

The deployment raises the grammar limits far enough that the grammar attack's schema (20k enum values, ~7 s of
compile on a 2-vCPU AMD EPYC) reaches the workers' compilers: what is tested there is the isolation itself (the
compile runs in a process of its own and is killed at --grammar-compile-timeout), not only the gateway's limit.
Asserted: the normal client gets no 5xx (only 200s), no worker leaves the registry, every attack is answered with a
4xx (the grammar attacker also 503/504: compilers busy with its own earlier requests, its own deadline), and the normal
client's p99 TTFT stays within a bound of the baseline phase's (docs/reliability.md, "Hostile neighbours", has the
figures this bound comes from).
"""
from __future__ import annotations

import asyncio
import os

import httpx
import pytest

from pdserve.bench import hostile
from tests.e2e.conftest import Up

# 3 s a phase: the normal client (closed loop, 4-token streams) still sends >= 5 requests in it, and the grammar
# attack's compiles (killed at --grammar-compile-timeout 2) run inside it
PHASE_S = float(os.environ.get("PDSERVE_HOSTILE_PHASE_S", "3"))
# Measured on a 2-vCPU AMD EPYC (docs/reliability.md): see the table there. Loose enough for a shared CI box,
# tight enough that any stall of the loop or an engine thread (seconds) fails it.
P99_RISE_S = 0.5


@pytest.fixture(scope="module")
def up(tiny_llama):
    u = Up(tiny_llama, "--mode", "disagg", "--max-enum-values", "100000", "--max-schema-bytes", "4000000",
           "--grammar-compile-timeout", "2")
    yield u
    u.stop()


def test_no_attack_takes_service_from_a_normal_client(up):
    with httpx.Client(base_url=up.base_url, timeout=10) as c:
        workers = sum(c.get("/health").json()["workers"].values())
        model = c.get("/v1/models").json()["data"][0]["id"]
    rows = asyncio.run(hostile.run(up.base_url, model, hostile.ATTACKS, PHASE_S, interval=1.0, enum_values=20_000))
    by = {r["phase"]: r for r in rows}
    for r in rows:
        print(r)  # the figures, for the run's log
        assert set(r["normal_status"]) == {200}, r
        assert r["workers_min"] == workers, f"a worker left the registry during {r['phase']}: {r}"
        assert r["requests"] >= 5, r
    for name in hostile.ATTACKS:
        codes = by[name]["attack_status"]
        # the grammar attacker may also see its own deadline pass (504) or every compiler taken by its earlier
        # requests (503, Retry-After) on a loaded box; never a 500, and nobody else sees either
        allowed = {400, 503, 504} if name == "grammar" else set(range(400, 500))
        assert codes and set(codes) <= allowed, (name, codes)
        rise = by[name]["ttft_p99_ms"] - by["baseline"]["ttft_p99_ms"]
        assert rise / 1e3 < P99_RISE_S, (name, by[name], by["baseline"])
