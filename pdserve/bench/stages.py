"""Per-request stage distributions from `usage.stage_times` (pdserve's extension, docs/services.md).

When the server returns stage times, each request contributes one sample per stage, so the breakdown is
p50/p90/p99 per stage instead of means over a load point. Servers without the extension fall back to the
Prometheus means (`promscrape.breakdown`).
"""
from __future__ import annotations

from typing import Sequence

from pdserve.bench import metrics as MX

# the gateway's consecutive stages (their sum is the gateway's E2E) + two spans over them. handoff and
# kv_transfer are in the sum only when the first token waited for the transfer (`kv_on_ttft_path`); otherwise
# they ran behind the first emit, inside `decode`, and the stacked breakdown counts them as 0.
SERVER_STAGES = ("admission", "route", "dispatch", "queue", "prefill", "handoff", "kv_transfer", "first_emit",
                 "decode", "ttft", "e2e")


def _durations(r: MX.ClientRecord) -> dict | None:
    st = r.stages
    d = st.get("durations") if isinstance(st, dict) else None
    if d and st.get("kv_on_ttft_path") is False:
        d = {**d, "handoff": 0.0, "kv_transfer": 0.0}  # overlapped by decode: not a stage of its own here
    return d


def client_to_gateway(r: MX.ClientRecord) -> float | None:
    """Client TTFT - gateway TTFT of the same request: both are durations, so the two clocks never mix."""
    d, t = _durations(r), MX.ttft(r)
    return t - d["ttft"] if d and d.get("ttft") is not None and t is not None else None


def distributions(records: Sequence[MX.ClientRecord]) -> dict | None:
    """{stage: describe(samples)} over the successful requests that carry stage times; None when none do."""
    ok = [r for r in records if r.ok and _durations(r)]
    if not ok:
        return None
    out = {k + "_s": MX.describe(_durations(r).get(k) for r in ok) for k in SERVER_STAGES}
    out["client_to_gateway_s"] = MX.describe(client_to_gateway(r) for r in ok)
    out["n_requests_with_stage_times"] = len(ok)
    return out


def breakdown_from(dist: dict) -> dict:
    """Means in the shape of `promscrape.breakdown` (what stages.png stacks): the small gateway-side stages are
    lumped into route_rpc_other as there."""
    def m(k: str) -> float:
        return (dist.get(k + "_s") or {}).get("mean") or 0.0

    return {"client_to_gateway_s": (dist.get("client_to_gateway_s") or {}).get("mean"),
            "route_rpc_other_s": sum(m(k) for k in ("admission", "route", "dispatch", "handoff", "first_emit")),
            "queue_s": m("queue"), "prefill_s": m("prefill"), "kv_transfer_s": m("kv_transfer"),
            "decode_s": m("decode")}
