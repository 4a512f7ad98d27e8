"""A worker's families: its engine, its KV pool, KV transfer. The `role` label (prefill / decode / both: the
pool) is added to every sample at exposition, with `model`."""
from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

from pdserve.services.metrics.common import FAST, LAT, REJECTIONS  # noqa: F401 - worker-side rejections

if TYPE_CHECKING:  # annotations only: this module imports no engine code (see _StateEntries)
    from pdserve.engine.kv_offload import TierStats
    from pdserve.engine.outputs import RequestOutput
    from pdserve.engine.stats import EngineStats

WORKER = CollectorRegistry(auto_describe=True)

QUEUE_TIME = Histogram("pdserve_queue_time_seconds", "Engine arrival -> first scheduled", buckets=LAT,
                       registry=WORKER)
PREFILL_TIME = Histogram("pdserve_prefill_time_seconds", "First scheduled -> first token", buckets=LAT,
                         registry=WORKER)
KV_TRANSFER_SECONDS = Histogram("pdserve_kv_transfer_seconds", "One batched NIXL READ of a request's blocks",
                                buckets=FAST, registry=WORKER)
KV_TRANSFER_BYTES = Counter("pdserve_kv_transfer_bytes_total", "Bytes pulled over NIXL", registry=WORKER)
# Decode-side prefix reuse (decode/pull_plan.py): per disaggregated request, the prompt blocks this worker's own
# prefix cache already held (not pulled) and the blocks it pulled
KV_PULL_REUSED_BLOCKS = Counter("pdserve_kv_pull_reused_blocks_total",
                                "Prompt blocks a decode worker's prefix cache supplied instead of a pull",
                                registry=WORKER)
KV_PULL_BLOCKS = Counter("pdserve_kv_pull_blocks_total", "Prompt blocks a decode worker pulled from a prefill worker",
                         registry=WORKER)
KV_TRANSFER_FAILURES = Counter("pdserve_kv_transfer_failures_total", "Failed or timed-out KV pulls", ["reason"],
                               registry=WORKER)
LEASES_EXPIRED = Counter("pdserve_kv_leases_expired_total", "Pinned KV freed by lease expiry (nobody pulled)",
                         registry=WORKER)
# Per worker pair, on the decode worker (it pulls; the scrape target is the other end of the pair): `peer` is the
# prefill worker's id, capped at decode/pair_metrics.MAX_PEERS distinct ids (later ones count as "other").
KV_PAIR_BYTES = Histogram("pdserve_kv_pair_transfer_bytes", "Bytes of one KV pull from the peer prefill worker",
                          ["peer"], buckets=(2**14, 2**16, 2**18, 2**20, 2**22, 2**24, 2**26, 2**28, 2**30, 2**32),
                          registry=WORKER)
KV_PAIR_SECONDS = Histogram("pdserve_kv_pair_transfer_seconds", "Duration of one KV pull from the peer prefill "
                            "worker (the batched NIXL READ, post to completion)", ["peer"], buckets=LAT,
                            registry=WORKER)
KV_PAIR_FAILURES = Counter("pdserve_kv_pair_failures_total", "Failed KV pulls from the peer prefill worker",
                           ["peer", "reason"], registry=WORKER)
KV_PAIR_LEASES_EXPIRED = Counter("pdserve_kv_pair_leases_expired_total", "KV pulls from the peer refused because "
                                 "the peer's lease on the blocks ran out first", ["peer"], registry=WORKER)
KV_PAIR_PROBE_LATENCY = Gauge("pdserve_kv_pair_probe_latency_seconds", "The transport self-test's one-block READ "
                              "from the peer, post to completion (kv_transfer/probe.py)", ["peer"], registry=WORKER)
KV_PAIR_PROBE_BANDWIDTH = Gauge("pdserve_kv_pair_probe_bytes_per_second", "The transport self-test's bandwidth from "
                                "the peer: a READ sized to take ~0.25 s, at most 4 MiB", ["peer"], registry=WORKER)
KV_TRANSPORT_INFO = Gauge("pdserve_kv_transport_info", "1, labelled with the KV transfer's backend and transport "
                          "as configured (transport: UCX_TLS's transports, or auto; source: configured when UCX_TLS is "
                          "set, default when UCX picks per peer: kv_transfer/transport.py)",
                          ["backend", "transport", "source"], registry=WORKER)
KV_PAIR_TRANSPORT_INFO = Gauge("pdserve_kv_pair_transport_info", "1, labelled with the UCX transport(s) that carried "
                               "the READs from the peer, as UCX reported its choice (cma, tcp, posix, rc_mlx5, ..., "
                               "or unknown: kv_transfer/ucx_proto_info.py)", ["peer", "observed"], registry=WORKER)
KV_HANDSHAKES = Counter("pdserve_kv_handshakes_total", "KV handshakes between a decode and a prefill worker "
                        "(side: initiated on the decode worker, served on the prefill worker)", ["side"],
                        registry=WORKER)
KV_EVENTS_PUBLISHED = Counter("pdserve_kv_events_published_total", "KV events a worker published", ["kind"],
                              registry=WORKER)
GRAMMAR_COMPILE_SECONDS = Histogram(
    "pdserve_grammar_compile_seconds", "A guided request's constraint, checked and compiled off the engine thread "
    "(engine/grammar_pool.py); outcome: ok, cached, over_limit, invalid, timeout (over --grammar-compile-timeout), "
    "deadline, busy, cancelled", ["outcome"], buckets=(0.001, 0.005, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
    registry=WORKER)
GRAMMAR_CACHE_BYTES = Gauge("pdserve_grammar_cache_bytes", "Compiled grammars kept by the worker's compile cache",
                            registry=WORKER)
TERMINAL = Counter("pdserve_engine_requests_terminal_total", "Engine requests on this worker reaching a terminal "
                   "state (a client request is one or more engine requests; the gateway counts client requests)",
                   ["state"], registry=WORKER)

# ---- from the engine's stats snapshot (EngineStatsExporter) --------------------------------------------------
KV_BLOCKS_IN_USE = Gauge("pdserve_kv_blocks_in_use", "KV blocks allocated (incl. pinned for transfer)",
                         registry=WORKER)
KV_BLOCKS_TOTAL = Gauge("pdserve_kv_blocks_total", "KV blocks in the pool", registry=WORKER)
KV_BLOCKS_PINNED = Gauge("pdserve_kv_blocks_pinned", "Prefill-side blocks pinned under a lease", registry=WORKER)
KV_USAGE = Gauge("pdserve_kv_usage_fraction", "KV blocks in use / KV blocks in the pool (0..1)", registry=WORKER)
PREFIX_QUERIES = Counter("pdserve_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache",
                         registry=WORKER)
PREFIX_HITS = Counter("pdserve_prefix_cache_hits_total", "Prompt tokens found in the prefix cache", registry=WORKER)
PREFIX_HIT_RATIO = Gauge("pdserve_prefix_hit_ratio", "DEPRECATED (cannot be aggregated across workers): lifetime "
                         "prefix-cache hit ratio; use pdserve_prefix_cache_hits_total / "
                         "pdserve_prefix_cache_queries_total", registry=WORKER)
# host / disk KV tier (engine/kv_offload.py; docs/engine.md, Host KV tier)
KV_TIER_HITS = Counter("pdserve_kv_tier_hit_tokens_total", "Prompt tokens found in the prefix cache, by the tier "
                       "that held them (device: the pool; host / disk: recalled from the offload tier)", ["tier"],
                       registry=WORKER)
KV_OFFLOAD_BYTES = Counter("pdserve_kv_offload_bytes_total", "KV bytes moved between the tiers", ["direction"],
                           registry=WORKER)
KV_RECALL_SECONDS = Histogram("pdserve_kv_recall_seconds", "One recall of a prefix from the host / disk tier "
                              "(start of the background copy -> its blocks usable)", buckets=FAST, registry=WORKER)
KV_TIER_BLOCKS = Gauge("pdserve_kv_tier_blocks", "KV blocks held in the host / disk tier", ["tier"],
                       registry=WORKER)
KV_TIER_CAPACITY = Gauge("pdserve_kv_tier_capacity_blocks", "KV blocks the host / disk tier can hold", ["tier"],
                         registry=WORKER)
# mixture-of-experts load balance (engine/moe.py): the router's choices, summed over the MoE layers
EXPERT_TOKENS = Counter("pdserve_moe_expert_tokens_total", "Token-to-expert assignments by the router, summed over "
                        "the MoE layers (a token counts once per expert it is routed to)", ["expert"],
                        registry=WORKER)
EXPERT_IMBALANCE = Gauge("pdserve_moe_expert_imbalance", "Tokens of the busiest expert over the mean per expert, "
                         "since start, in the most imbalanced MoE layer (1: perfectly balanced)", registry=WORKER)
NUM_RUNNING = Gauge("pdserve_num_running", "Requests running in the engine", registry=WORKER)
NUM_WAITING = Gauge("pdserve_num_waiting", "Requests waiting in the engine", registry=WORKER)
STATE_GAUGE = Gauge("pdserve_requests_in_state", "Live engine sequences per state", ["state"], registry=WORKER)
# Speculative decoding (engine/spec_decode/): counters from the engine's cumulative counts, and lifetime ratios.
SPEC_STEPS = Counter("pdserve_spec_verify_steps_total", "Speculative verification passes (one per sequence and step)",
                     registry=WORKER)
SPEC_PROPOSED = Counter("pdserve_spec_proposed_tokens_total", "Speculative candidates verified by the target",
                        registry=WORKER)
SPEC_ACCEPTED = Counter("pdserve_spec_accepted_tokens_total", "Speculative candidates accepted", registry=WORKER)
SPEC_EMITTED = Counter("pdserve_spec_emitted_tokens_total", "Tokens committed by verification passes (accepted "
                       "candidates + the bonus / residual token)", registry=WORKER)
SPEC_ACCEPTANCE = Gauge("pdserve_spec_acceptance_rate", "Lifetime accepted / proposed candidates (0..1)",
                        registry=WORKER)
SPEC_MEAN_LEN = Gauge("pdserve_spec_mean_accepted_length", "Lifetime tokens committed per verification pass",
                      registry=WORKER)
ENGINE_INFO = Gauge("pdserve_engine_info", "1, labelled with what this worker's engine runs on: the CPU ISA level "
                    "used (or the accelerator), the compute dtype, how the projection weights are held (int8 | bfloat16 | the compute dtype), and the kernels "
                    "(native | triton | torch)", ["isa", "dtype", "weights", "kernels"], registry=WORKER)

READY_SECONDS = Gauge("pdserve_worker_ready_seconds", "Cold start (spec §1.5), set once: phase=load: process start "
                      "-> model loaded; warmup: the warm-up forwards' own time; ready: process start -> registered "
                      "and SERVING (kept out of steady-state latency: nothing is routed here before it)", ["phase"],
                      registry=WORKER)


def process_start_time() -> float | None:
    """Unix time this process started (/proc; None where there is none): cold start counts imports too."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        import os
        return btime + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def set_engine_info(info) -> None:
    """One sample for this process's engine (engine.cpu_isa.EngineInfo), set once at start."""
    ENGINE_INFO.clear()
    ENGINE_INFO.labels(info.isa, info.dtype, info.weights or info.dtype, info.kernels).set(1)


def set_transport_info(t) -> None:
    """One sample for this worker's KV transport (kv_transfer/transport.Transport), set once at start."""
    KV_TRANSPORT_INFO.clear()
    KV_TRANSPORT_INFO.labels(t.backend, t.transport, t.source).set(1)


def observe_engine_times(out: RequestOutput | None) -> None:
    """Queue and prefill time of a request from its engine output's timestamps (a worker's first output)."""
    t = out.times if out is not None else None
    if t is None:
        return
    if t.first_scheduled is not None:
        QUEUE_TIME.observe(max(0.0, t.first_scheduled - t.arrival))
        if t.first_token is not None:
            PREFILL_TIME.observe(max(0.0, t.first_token - t.first_scheduled))


class EngineStatsExporter:
    """Engine stats snapshot -> the gauges above, and the engine's cumulative counts (prefix-cache tokens, KV tier
    hits and bytes, speculation) -> the counters, each incremented by what grew since the last snapshot, so they
    stay counters Prometheus can rate and sum across workers."""

    def __init__(self, states: list[str]):
        self.states = states
        self._exported: dict[object, int] = {}  # counter (or labelled child) -> the engine total last exported
        self.recalls = 0  # KV tier recalls whose latencies were observed

    def _advance(self, counter, total: int) -> None:
        last = self._exported.get(counter, 0)
        if total > last:
            counter.inc(total - last)
            self._exported[counter] = total

    def update(self, s: EngineStats) -> None:
        used, total = s.kv_blocks_in_use, s.kv_blocks_total
        KV_BLOCKS_IN_USE.set(used)
        KV_BLOCKS_TOTAL.set(total)
        KV_USAGE.set(used / total if total else 0.0)
        KV_BLOCKS_PINNED.set(s.kv_blocks_pinned)
        PREFIX_HIT_RATIO.set(s.prefix_hit_ratio)
        NUM_RUNNING.set(s.num_running)
        NUM_WAITING.set(s.num_waiting)
        for st in self.states:
            STATE_GAUGE.labels(st).set(s.states.get(st, 0))
        self._advance(PREFIX_QUERIES, s.prefix_queried_tokens)
        self._advance(PREFIX_HITS, s.prefix_hit_tokens)
        spec = s.spec
        if spec is not None:
            self._advance(SPEC_STEPS, spec.steps)
            self._advance(SPEC_PROPOSED, spec.proposed)
            self._advance(SPEC_ACCEPTED, spec.accepted)
            self._advance(SPEC_EMITTED, spec.emitted)
            SPEC_ACCEPTANCE.set(spec.acceptance_rate)
            SPEC_MEAN_LEN.set(spec.mean_accepted_length)
        if s.tier is not None:
            self._tier(s.tier, s.prefix_hit_tokens)
        if s.expert_tokens:
            self._experts(s.expert_tokens)

    def _experts(self, rows: list[list[int]]) -> None:
        for e, n in enumerate(map(sum, zip(*rows))):
            self._advance(EXPERT_TOKENS.labels(str(e)), n)
        ratios = [max(r) * len(r) / sum(r) for r in rows if sum(r)]
        if ratios:
            EXPERT_IMBALANCE.set(max(ratios))

    def _tier(self, t: TierStats, prefix_hit_tokens: int) -> None:
        KV_TIER_BLOCKS.labels("host").set(t.host_blocks_in_use)
        KV_TIER_CAPACITY.labels("host").set(t.host_blocks_total)
        KV_TIER_BLOCKS.labels("disk").set(t.disk_blocks_in_use)
        KV_TIER_CAPACITY.labels("disk").set(t.disk_blocks_total)
        hits = {**t.hit_tokens, "device": max(0, prefix_hit_tokens - sum(t.hit_tokens.values()))}
        for tier, n in hits.items():
            self._advance(KV_TIER_HITS.labels(tier), n)
        for direction, n in t.bytes_moved.items():
            self._advance(KV_OFFLOAD_BYTES.labels(direction), n)
        n, recent = t.recalls, t.recall_seconds
        if n > self.recalls:  # the latest latencies come last; older ones than the list keeps are not seen
            for x in recent[max(0, len(recent) - (n - self.recalls)):]:
                KV_RECALL_SECONDS.observe(x)
            self.recalls = n


class _StateEntries:
    """`pdserve_request_state_entries_total{state}`: how often sequences entered each of the 14 states in this
    process (transient states such as RUNNABLE / RESUMED last less than a tick, so only a counter shows them)."""

    def describe(self):  # the registry's name check, without importing the engine here
        return [self._family()]

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily("pdserve_request_state_entries", "Sequences entering each state", labels=["state"])

    def collect(self):
        from pdserve.engine.request_state import ENTERED
        m = self._family()
        for state, n in ENTERED.items():
            m.add_metric([state], n)
        yield m


WORKER.register(_StateEntries())

# ---- role switches (services/role_switch.py) -----------------------------------------------------------------
ROLE_SWITCHES = Counter("pdserve_role_switches_total", "Role switches requested of this worker, by the role left, "
                        "the role asked for and the outcome (switched, drain_timeout, failed)",
                        ["from_role", "to_role", "outcome"], registry=WORKER)
ROLE_SWITCH_HANDOFFS = Counter("pdserve_role_switch_handoffs_total", "Streams a role switch (handoff migrate) ended "
                               "mid-stream for the gateway to resume on another worker", registry=WORKER)
ROLE_SWITCH_SECONDS = Histogram("pdserve_role_switch_seconds", "A successful role switch: the request's arrival "
                                "-> serving in the new role (registered), drain included",
                                buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120), registry=WORKER)
