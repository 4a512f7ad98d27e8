"""vLLM-named aliases of pdserve's families (`--metrics-compat vllm`), for the dashboards, autoscaler examples and
benchmark tools (aiperf's server-metrics view) that know vLLM's names. The mapping table is docs/metrics.md.

Each alias is built from the very samples of its native family in the same scrape (`aliases(natives)`), so an
alias and its source cannot disagree. Labels follow vLLM's convention: `model` becomes `model_name`; the native
family's other labels stay (a PromQL `sum by (le)` over them is what a vLLM dashboard does anyway)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample


@dataclass(frozen=True)
class Alias:
    name: str  # vLLM's family name (counters without `_total`, as prometheus_client names families)
    native: str  # pdserve's family name, same convention
    only: dict[str, str] = field(default_factory=dict)  # keep samples with these labels, then drop the labels


ALIASES = (
    # gateway: client-request latency and token counts
    Alias("vllm:time_to_first_token_seconds", "pdserve_ttft_seconds"),
    Alias("vllm:e2e_request_latency_seconds", "pdserve_e2e_seconds"),
    Alias("vllm:inter_token_latency_seconds", "pdserve_itl_seconds"),
    Alias("vllm:time_per_output_token_seconds", "pdserve_tpot_seconds"),
    Alias("vllm:prompt_tokens", "pdserve_prompt_tokens"),
    Alias("vllm:generation_tokens", "pdserve_generation_tokens"),
    Alias("vllm:request_success", "pdserve_requests_terminal", {"state": "FINISHED"}),
    Alias("vllm:request_prompt_tokens", "pdserve_request_prompt_tokens"),
    Alias("vllm:request_generation_tokens", "pdserve_request_output_tokens"),
    # workers: engine queue, KV pool, prefix cache
    Alias("vllm:num_requests_running", "pdserve_num_running"),
    Alias("vllm:num_requests_waiting", "pdserve_num_waiting"),
    Alias("vllm:kv_cache_usage_perc", "pdserve_kv_usage_fraction"),
    Alias("vllm:prefix_cache_queries", "pdserve_prefix_cache_queries"),
    Alias("vllm:prefix_cache_hits", "pdserve_prefix_cache_hits"),
    # decode workers: the KV pulls (vLLM's NixlConnector families; `peer` stays: the prefill worker pulled from)
    Alias("vllm:nixl_xfer_time_seconds", "pdserve_kv_pair_transfer_seconds"),
    Alias("vllm:nixl_bytes_transferred", "pdserve_kv_pair_transfer_bytes"),
    Alias("vllm:nixl_num_failed_transfers", "pdserve_kv_pair_failures"),
)
_BY_NATIVE: dict[str, list[Alias]] = {}
for _a in ALIASES:
    _BY_NATIVE.setdefault(_a.native, []).append(_a)


def _relabel(labels: dict[str, str], only: dict[str, str]) -> dict[str, str] | None:
    if any(labels.get(k) != v for k, v in only.items()):
        return None
    out = {("model_name" if k == "model" else k): v for k, v in labels.items() if k not in only}
    return out


def aliases(natives: Iterable[Metric]) -> Iterable[Metric]:
    """The vLLM-named copies of those of `natives` that have one (a family the process does not own has none)."""
    for fam in natives:
        for a in _BY_NATIVE.get(fam.name, ()):
            m = Metric(a.name, f"{fam.documentation} (alias of {fam.name})", fam.type, fam.unit)
            for s in fam.samples:
                labels = _relabel(s.labels, a.only)
                if labels is not None:  # sample suffixes (_bucket, _sum, _count, _total, _created) carry over
                    m.samples.append(Sample(a.name + s.name[len(fam.name):], labels, s.value, s.timestamp,
                                            s.exemplar))
            yield m
