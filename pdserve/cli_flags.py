"""Flag groups that several commands declare, and the checks on them: the internal transport's security flags
(up, gateway, router, worker, planner) and the planner's (`pdserve planner`, `pdserve up --planner`).

Here rather than in `cli.py` or `planner/cli.py` so that the command modules and `services/preflight.py` share them
without importing each other (tests/test_import_graph.py). Imports nothing of pdserve but `cli_args` and the
speculative-decoding flags (argparse only). Also the engine's flags, declared once: `add_engine`, `ENGINE_FLAGS`.
"""
from __future__ import annotations

import argparse

from pdserve.cli_args import context_len, fraction, nonneg_float, nonneg_int, positive_float, positive_int
from pdserve.engine.spec_decode.flags import add_spec_flags

# The same names the engine validates (pdserve/engine/config.py, which imports torch; the CLI must not).
POLICIES = ("fcfs", "decode-priority", "prefill-priority", "priority", "shortest-predicted-first")
DTYPES = ("auto", "float32", "bfloat16", "float16")
BATCHING = ("continuous", "static")
PREEMPTION_MODES = ("recompute", "swap")


def add_security(p: argparse.ArgumentParser) -> None:
    """Internal transport security (docs/services.md, Trust model). Secrets come as files, never as values; the
    files are read (and a missing one reported) once the command line is parsed: `cli._check_security`."""
    p.add_argument("--internal-token-file",
                   help="shared token for router/worker RPCs and registry records (a mounted Secret)")
    p.add_argument("--tls-cert", help="PEM certificate for internal gRPC (with --tls-key)")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument("--tls-ca",
                   help="PEM CA: servers require client certificates it signed (mTLS), clients verify servers by it")
    p.add_argument("--tls-server-name", help="name internal servers' certificates carry (default: the dialed host)")
    p.add_argument("--redis-password-file", help="Redis AUTH password (username, if any, in --redis-url)")
    p.add_argument("--redis-ca-file", help="PEM CA for a rediss:// (TLS) Redis")
    p.add_argument("--insecure-internal", action="store_true", default=None,  # None: help prints no default
                   help="run without internal authentication, said at WARNING (up: generate no token or Redis "
                        "password; router/worker: serve a non-loopback address without a token or mTLS)")


def add_planner_flags(p) -> None:
    """What `pdserve up --planner` and `pdserve planner` share."""
    p.add_argument("--planner-interval", type=positive_float, default=30.0, help="seconds between decisions")
    p.add_argument("--slo-ttft", type=positive_float, default=0.5, help="TTFT SLO (p90, seconds) the planner sizes for")
    p.add_argument("--slo-tpot", type=positive_float, default=0.05, help="TPOT SLO (p90, seconds)")
    p.add_argument("--min-prefill", type=positive_int, default=1, help="planner: fewest prefill workers")
    p.add_argument("--max-prefill", type=positive_int, default=4, help="planner: most prefill workers")
    p.add_argument("--min-decode", type=positive_int, default=1, help="planner: fewest decode workers")
    p.add_argument("--max-decode", type=positive_int, default=4, help="planner: most decode workers")
    p.add_argument("--scale-down-cooldown", type=nonneg_float, default=None,
                   help="seconds after a pool's last change before it may shrink (default: 2 intervals)")
    p.add_argument("--planner-window", type=positive_int, default=6,
                   help="intervals the forecast looks back (a pool shrinks only when all of them needed fewer)")
    p.add_argument("--headroom", type=positive_float, default=1.2, help="size for the forecast rate x this")
    p.add_argument("--worker-start-s", type=positive_float, default=None,
                   help="planner: seconds a new worker takes to serve (default 30); a role switch is used instead "
                        "of start + drain only while the expected drain + the switch are shorter")
    p.add_argument("--attainment", type=positive_float, default=0.9, help="target SLO attainment in simulation")


def add_up_flags(up) -> None:
    up.add_argument("--planner", action="store_true", default=None,  # None: no "(default: False)" in --help
                    help="run the SLA planner in this process: it adds and drains workers (docs/planner.md)")
    add_planner_flags(up)


def check_limits(a) -> str | None:
    for pool in ("prefill", "decode"):
        lo, hi = getattr(a, f"min_{pool}"), getattr(a, f"max_{pool}")
        if lo > hi:
            return f"--min-{pool} {lo} is above --max-{pool} {hi}"
    if a.planner_window < 2:
        return "--planner-window needs at least 2 intervals"
    return None


def check_up_planner(a) -> str | None:
    if a.mode == "colocated":
        return "--planner sizes prefill and decode pools: use --mode auto or disagg"
    return check_limits(a)


def add_engine(p: argparse.ArgumentParser) -> None:
    """The engine's flags (`up` and `worker`): every one defaults to None, the engine's own default."""
    p.add_argument("--num-gpu-blocks", type=positive_int, help="KV blocks (default: from the KV memory budget)")
    p.add_argument("--kv-cache-bytes", type=positive_int,
                   help="KV pool bytes when --num-gpu-blocks is unset (default: CUDA: --gpu-memory-utilization; "
                        "CPU: 256 MiB)")
    p.add_argument("--gpu-memory-utilization", type=fraction,
                   help="fraction of the GPU's memory for weights + activations + KV pool; the pool takes what "
                        "is left after loading and a profiling forward (default: 0.9)")
    p.add_argument("--block-size", type=positive_int, help="tokens per KV block (default: 16)")
    p.add_argument("--max-num-seqs", type=positive_int, help="sequences per batch (default: the engine's)")
    p.add_argument("--max-num-batched-tokens", type=positive_int, help="tokens per step (default: 2048)")
    p.add_argument("--max-model-len", type=context_len,
                   help="context limit in tokens, prompt + output (default: the checkpoint's)")
    p.add_argument("--preemption-mode", choices=PREEMPTION_MODES,
                   help="when KV blocks run out, a running sequence's KV is dropped and recomputed, or swapped to "
                        "host memory (needs --swap-space) (default: recompute)")
    p.add_argument("--swap-space", type=nonneg_float,
                   help="GiB of host memory (pinned on CUDA) for swapped-out KV, per worker (default: 0)")
    p.add_argument("--device", help="cpu | cuda | cuda:N (default: cpu)")
    p.add_argument("--dtype", choices=DTYPES, help="weights and KV dtype (default: the checkpoint's)")
    p.add_argument("--quantization", choices=("none", "int8"),
                   help="weight-only int8 projections and lm_head, per-channel scales; CPU only (default: none; "
                        "docs/engine.md, Weight-only int8)")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8_e4m3"),
                   help="KV pool storage: auto (the compute dtype) or fp8_e4m3 (one byte per value, no scales: 2x "
                        "the tokens of a bf16 pool, 4x fp32, and half the bytes moved prefill -> decode; prefill "
                        "and decode workers must agree; attention on the torch path; docs/engine.md, KV-cache "
                        "quantization) (default: auto)")
    p.add_argument("--policy", choices=POLICIES, help="scheduling policy (default: fcfs)")
    p.add_argument("--batching", choices=BATCHING,
                   help="continuous (iteration-level refill) or static (a batch runs until all its members finish; "
                        "the baseline, docs/engine.md) (default: continuous)")
    p.add_argument("--threads", type=positive_int,
                   help="torch intra-op threads (default: all cores; `up` splits the cores between workers)")
    p.add_argument("--kv-offload-bytes", type=nonneg_int,
                   help="host memory (bytes, per worker) keeping prefix-cache blocks evicted from the KV pool, "
                        "recalled on a prefix hit instead of recomputed (pinned on CUDA; docs/engine.md, Host KV "
                        "tier); 0: off")
    p.add_argument("--kv-offload-dir", help="spill the host KV tier's LRU victims to files under this directory")
    p.add_argument("--kv-offload-disk-bytes", type=nonneg_int,
                   help="disk KV tier capacity (default: 4 x --kv-offload-bytes)")
    p.add_argument("--deterministic", action="store_true", default=None,  # None: help prints no default
                   help="batch-invariant steps: each row computed by the same kernels in the same reduction order "
                        "whatever the batch, chunking or prefix-cache hit, so greedy and seeded output is "
                        "reproducible (slower; docs/engine.md, Deterministic mode)")
    p.add_argument("--no-decode-prefix-reuse", action="store_true", default=None,  # None: no default printed
                   help="decode workers pull every prompt block from the prefill worker, even the prefix their own "
                        "prefix cache holds (the next turn of a chat); for comparison (docs/kv_transfer.md)")
    p.add_argument("--tensor-parallel-size", type=positive_int,
                   help="ranks of tensor parallelism per worker, one process each (default: 1; docs/engine.md)")
    p.add_argument("--expert-parallel-size", type=positive_int,
                   help="a mixture-of-experts model's experts split whole over the ranks: 1, "
                        "--tensor-parallel-size, or any size at --tensor-parallel-size 1 (attention replicated on "
                        "every rank) (default: 1; docs/engine.md, Expert parallelism)")
    p.add_argument("--expert-dispatch", choices=("auto", "all_to_all", "all_reduce"),
                   help="how expert-parallel ranks reach the experts others hold: all_to_all sends each token row "
                        "only to its expert's rank and back; all_reduce sums every rank's experts' share over "
                        "every token (fewer collectives per step); auto: all_to_all where it moves fewer bytes "
                        "(top-k < ranks; 2 x top-k < ranks with attention replicated) (default: auto; docs/engine.md, Expert "
                        "parallelism)")
    add_spec_flags(p)


def _dests(add) -> tuple[str, ...]:
    p = argparse.ArgumentParser(add_help=False)
    add(p)
    return tuple(a.dest for a in p._actions)


# The one list of engine options: what `add_engine` declares. `up` forwards each one given (services/up.py), the
# worker builds its EngineConfig from them (services/worker.py engine_config_from_args), by these names.
ENGINE_FLAGS = _dests(add_engine)
SPEC_FLAGS = _dests(add_spec_flags)  # EngineConfig fields of their own (spec_decode/flags.py spec_config)
ENGINE_FIELD = {"threads": "num_threads"}  # flag dest -> EngineConfig field, where they differ


def engine_kwargs(args) -> dict:
    """EngineConfig fields from the engine flags that were given (None: the engine's default)."""
    return {ENGINE_FIELD.get(d, d): getattr(args, d) for d in ENGINE_FLAGS
            if d not in SPEC_FLAGS and getattr(args, d, None) is not None}


def engine_argv(args, skip: tuple[str, ...] = ()) -> list[str]:
    """The engine flags that were given, as a command line (`up` -> its workers)."""
    out = []
    for d in ENGINE_FLAGS:
        v = getattr(args, d, None)
        if v is None or d in skip:
            continue
        flag = "--" + d.replace("_", "-")
        out += [flag] if v is True else [flag, str(v)]  # a switch (store_true) takes no value
    return out
