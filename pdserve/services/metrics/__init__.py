"""Prometheus metrics, split by the process that owns them (docs/metrics.md).

Each process exports its own families and nothing else: `gateway.py` (client-request latency, admission,
billing, HTTP), `router.py` (placement, prefix index), `worker.py` (engine, KV pool, KV transfer), plus the few in
`common.py` every process has (its own rejections, process/runtime collectors). Families live in per-role
registries, never the global one, so importing a module of another role (the worker imports admission code, the
gateway imports router helpers) cannot make its families appear. `exposition.py` builds what a process serves:
its role's families with the constant labels (`model`, and `role` on workers), and the vLLM-named aliases when
asked for (`vllm_compat.py`).
"""
