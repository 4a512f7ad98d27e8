"""Failure-domain spread, price and fairness terms of the router (spec §4.5, §6.1, Q15; docs/routing.md
"Failure domains, price and fairness"): the real Policy and cost model on hand-built load reports; the expected
numbers are worked out by hand from the documented formulas (rate 4000 tokens/s, overhead 10 ms, decode step
10 ms + 0.5 ms per sequence)."""
import random

import pytest

from pdserve.cli_args import labels_arg, weights_arg
from pdserve.services.pb import common_pb2
from pdserve.services.registry import WorkerRecord, record_from_pb, record_to_pb
from pdserve.services.router.cache_aware import Policy, RouteInput
from pdserve.services.router.prefix_index import PrefixIndex, chain_hashes
from pdserve.services.router.spread import RouteWeights

FP, BS = "sim-model", 16


def rec(wid, pending=0, **labels):
    return WorkerRecord(wid, "both", f"sim:{wid}", capacity_blocks=1000,
                        layout=common_pb2.KvLayout(fingerprint=FP, block_size=BS, block_bytes=1024),
                        load=common_pb2.LoadReport(
                            pending_prefill_tokens=pending, kv_blocks_total=1000, prefill_tokens_per_s=4000.0,
                            prefill_overhead_s=0.01, decode_step_s=0.01, decode_step_per_seq_s=0.0005,
                            report_time=1e12),
                        labels={k: str(v) for k, v in labels.items()})


FOUR = [rec("a1", zone="a", node="n1"), rec("a2", zone="a", node="n2"),
        rec("b1", zone="b", node="n3"), rec("b2", zone="b", node="n4")]


def policy(index=None, **w) -> Policy:
    return Policy("auto", index=index, rng=random.Random(0), inflight_ttl_s=0,  # loads stay as reported
                  weights=RouteWeights(**{"zone": 0.0, "node": 0.0, **w}))


def header(p) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in p.header().split(";"))


def test_labels_travel_through_the_registry_proto_and_flags():
    r = rec("w", zone="eu-1a", node="n7", price="2.5")
    back = record_from_pb(common_pb2.WorkerInfo.FromString(record_to_pb(r).SerializeToString()))
    assert back.labels == {"zone": "eu-1a", "node": "n7", "price": "2.5"}
    assert labels_arg("zone=a, node=n1") == {"zone": "a", "node": "n1"} and labels_arg("") == {}
    assert weights_arg("zone=0.1,fairness=2") == {"zone": 0.1, "fairness": 2.0}
    for bad in ("zone", "price=-1", "price=x"):
        with pytest.raises(Exception):
            labels_arg(bad)
    for bad in ("speed=1", "zone=-1", "zone=x"):
        with pytest.raises(Exception):
            weights_arg(bad)


def test_fd_term_matches_the_documented_numbers():
    pol = policy(zone=0.1, node=0.04)
    req = lambda: RouteInput("r", list(range(1, 65)), namespace="tenant:t", max_tokens=16)  # noqa: E731
    ids = {w.worker_id for w in FOUR}
    for forced in ("a1", "a1", "a2", "b1"):  # history of this prefix/tenant: zone a 3/4, b 1/4
        assert pol.place(FOUR, exclude=ids - {forced}, req=req()).both.worker_id == forced
    # fd(a1) = 0.1 x 0.75 + 0.04 x 0.5 = 0.095; a2 0.085; b1 0.025 + 0.01 = 0.035; b2 0.025: equal loads -> b2
    p = pol.place(FOUR, req=req())
    h = header(p)
    assert p.both.worker_id == "b2" and h["zone"] == "b" and h["fd_s"] == "0.0250"
    assert h["price_s"] == "0.0000" and h["fair_s"] == "0.0000"


@pytest.mark.parametrize("zone_w, expect", [(0.0, 1.0), (0.1, 0.62), (0.2, 0.56)])
def test_hot_prefix_spreads_across_zones(zone_w, expect):
    """A 64-token prompt whose first 48 tokens are cached on a1 only: a1 is 2 x 48 / 4000 = 0.024 s cheaper
    (prefill + work term). The fd term sends a placement to zone b once zone_w x (s_a - s_b) exceeds 0.024,
    so zone a's share settles at (1 + 0.024 / zone_w) / 2: 0.62 at 0.1, 0.56 at 0.2; 1.0 without the term."""
    prompt = list(range(1, 65))
    idx = PrefixIndex()
    for h in chain_hashes(prompt, BS, FP, "tenant:t"):
        idx.add("a1", ("tenant:t", h))
    pol = policy(idx, zone=zone_w)
    picks = [pol.place(FOUR, req=RouteInput("r", prompt, namespace="tenant:t", max_tokens=16)).both
             for _ in range(64)]
    share_a = sum(1 for w in picks if w.labels["zone"] == "a") / len(picks)
    assert share_a == pytest.approx(expect, abs=0.05)
    if zone_w:
        assert {w.worker_id for w in picks} & {"b1", "b2"}  # placements really went to the other zone


@pytest.mark.parametrize("weight, expect", [(0.0, "w1"), (0.15, "w1"), (0.23, "w0")])
def test_price_weight_changes_the_choice_as_the_formula_says(weight, expect):
    """w0: price 1, 400 tokens queued (0.1 s slower); w1: price 3, idle. Worker-seconds of a 400-token prompt
    with 16 output tokens: 400 / 4000 + 16 x (0.01 + 0.0005) / 1 = 0.268, so w1 costs 2 x 0.268 x weight more:
    break-even at weight 0.1 / 0.536 = 0.187."""
    ws = [rec("w0", pending=400, price=1), rec("w1", price=3)]
    p = policy(price=weight).place(ws, req=RouteInput("r", list(range(1, 401)), namespace="tenant:t", max_tokens=16))
    assert p.both.worker_id == expect
    assert float(header(p)["price_s"]) == pytest.approx(weight * (1 if expect == "w0" else 3) * 0.268, abs=1e-4)


@pytest.mark.parametrize("weight, expect_a", [(0.0, "w0"), (0.06, "w0"), (0.1, "w1")])
def test_fairness_weight_steers_a_tenant_above_its_share(weight, expect_a):
    """History: tenant A 6 placements on w1, tenant B 2 on w0. over(A) = 6/8 - 1/2 = 0.25, others(A, w0) = 2:
    fair(w0) = weight x 0.5. w1 has 160 tokens queued (0.04 s slower): A moves to w1 once 0.5 x weight > 0.04
    (weight > 0.08). B is within its share (over = 0): never charged."""
    ws = [rec("w0"), rec("w1", pending=160)]

    def hist(pol):
        for _ in range(6):
            pol.place(ws, exclude={"w0"}, req=RouteInput("r", list(range(1, 41)), namespace="A", max_tokens=16))
        for _ in range(2):
            pol.place(ws, exclude={"w1"}, req=RouteInput("r", list(range(1, 41)), namespace="B", max_tokens=16))
        return pol

    p = hist(policy(fairness=weight)).place(ws, req=RouteInput("r", list(range(1, 41)), namespace="A",
                                                                max_tokens=16))
    assert p.both.worker_id == expect_a
    if expect_a == "w0":
        assert float(header(p)["fair_s"]) == pytest.approx(weight * 0.5)
    q = hist(policy(fairness=weight)).place(ws, req=RouteInput("r", list(range(1, 41)), namespace="B",
                                                                max_tokens=16))
    assert q.both.worker_id == "w0" and header(q)["fair_s"] == "0.0000"
