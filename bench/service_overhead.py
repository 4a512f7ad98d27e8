"""What the services add on top of the engine, measured in one run on the built-in model.

    python bench/service_overhead.py [--requests 20] [--streams 16]

1. End-to-end overhead: client-side TTFT through `pdserve up --mode disagg` minus the engine-only TTFT of the
   same prompt (in-process `Engine`, same thread count), with the KV transfer time (from the response's
   `usage.stage_times`) shown apart. Target: overhead minus transfer <= 10 ms.
2. Gateway relay capacity: streamed tokens the gateway relays per second of its own CPU time (from
   /proc/<pid>/stat), with `--streams` concurrent streaming clients on a colocated deployment.
3. Served decode throughput: `--streams` concurrent streams through `pdserve up --mode disagg` (1 prefill +
   1 decode worker, 1 thread each) vs the in-process `Engine` running the same batch (1 thread): tokens/s and the
   ratio, with the decode worker's CPU time per token. What the ratio leaves out is the serving path's own cost
   inside the decode worker (gRPC streams, the event loop, GIL hand-offs with the engine thread) plus the other
   processes sharing the CPU.
Requests run one at a time for (1), so queueing is not counted as overhead.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.engine.engine import Engine, EngineConfig  # noqa: E402
from pdserve.engine.sampling_params import SamplingParams  # noqa: E402
from pdserve.services.up_process import UpProcess  # noqa: E402

PROMPT = "The meaning of life is a question that many wise people have asked, and the answer"


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """CPU time of a process, or of one of its threads (the main thread: tid == pid)."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


_local = threading.local()


def stream_ttft(base: str, body: dict) -> tuple[float, dict, int]:
    """Client-side TTFT (request sent -> first content chunk), the final usage, and the chunks received.
    Each thread keeps one connection alive, as real clients do: connection set-up is not serving overhead."""
    client = getattr(_local, "client", None) or httpx.Client(timeout=60)
    _local.client = client
    t0 = time.perf_counter()
    ttft, usage, chunks = None, {}, 0
    with client.stream("POST", base + "/v1/completions", headers={"x-pdserve-debug": "stage-times"},
                       json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            msg = json.loads(line[6:])
            if msg.get("choices") and msg["choices"][0].get("text"):
                chunks += 1
                if ttft is None:
                    ttft = time.perf_counter() - t0
            if msg.get("usage"):
                usage = msg["usage"]
    return ttft, usage, chunks


def run_clients(n: int, client) -> None:
    """client(0) .. client(n - 1), each in its own thread (its own keep-alive connection), all at once."""
    ths = [threading.Thread(target=client, args=(k,)) for k in range(n)]
    for th in ths:
        th.start()
    for th in ths:
        th.join()


def engine_ttft(n: int, threads: int) -> list[float]:
    eng = Engine.from_pretrained("builtin", EngineConfig(num_threads=threads, enable_prefix_caching=False))
    out = []
    for i in range(n + 2):
        eng.add_request(f"r{i}", eng.tokenizer.encode(f"{i} {PROMPT}"), SamplingParams(temperature=0, max_tokens=1))
        while eng.has_unfinished():
            eng.step()
        t = eng.usage_records[-1].times
        out.append(t.first_token - t.arrival)
    return out[2:]  # the first calls warm up


def overhead(n: int) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PDSERVE_LOG_LEVEL="WARNING")
    up = UpProcess(["--model", "builtin", "--mode", "disagg", "--prefill", "1", "--decode", "1"], env, 180)
    try:
        body = {"model": "builtin", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
        for _ in range(3):
            stream_ttft(up.base_url, body)  # warm-up
        ttfts, xfers, stages = [], [], []
        for i in range(n):
            # a fresh prompt each time: no prefix-cache hit on either side
            t, usage, _ = stream_ttft(up.base_url, {**body, "prompt": f"{i} {PROMPT}"})
            ttfts.append(t)
            times = usage.get("stage_times", {})
            st = times.get("durations", {})
            # the transfer counts against TTFT only when the first token waited for it (it normally does not:
            # the gateway emits the first token from the Prefill reply while the KV moves)
            xfers.append(st.get("kv_transfer", 0.0) if times.get("kv_on_ttft_path", True) else 0.0)
            stages.append(st)
    finally:
        up.stop()
    threads = max(1, (os.cpu_count() or 1) // 2)  # what `up` gave each of its two workers
    eng = engine_ttft(n, threads)
    med = statistics.median
    print(f"engine-only TTFT (in process, {threads} thread(s)): median {med(eng) * 1e3:.1f} ms")
    print(f"disaggregated TTFT through HTTP (client side):    median {med(ttfts) * 1e3:.1f} ms")
    print(f"KV transfer on the TTFT path (stage_times):        median {med(xfers) * 1e3:.1f} ms")
    # handoff / kv_transfer: the decode side's pickup, behind the first emit unless kv_on_ttft_path
    for k in ("admission", "route", "dispatch", "queue", "prefill", "first_emit", "ttft", "handoff", "kv_transfer"):
        vals = [d[k] for d in stages if d.get(k) is not None]
        if vals:
            print(f"  gateway stage {k:12s} median {med(vals) * 1e3:7.2f} ms")
    over = med(ttfts) - med(eng)
    print(f"overhead = {over * 1e3:.1f} ms; minus transfer = {(over - med(xfers)) * 1e3:.1f} ms (target <= 10 ms)")


def relay(streams: int, tokens: int) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PDSERVE_LOG_LEVEL="WARNING")
    up = UpProcess(["--model", "builtin", "--mode", "colocated"], env, 180)
    try:
        gw = up.process("gateway")["pid"]
        body = {"model": "builtin", "prompt": PROMPT, "max_tokens": tokens, "temperature": 0.8,
                "ignore_eos": True}
        stream_ttft(up.base_url, body)
        counts = [0] * streams

        def client(k: int) -> None:
            counts[k] = stream_ttft(up.base_url, {**body, "seed": k})[2]

        c0, t0 = cpu_seconds(gw), time.perf_counter()
        run_clients(streams, client)
        wall, cpu = time.perf_counter() - t0, cpu_seconds(gw) - c0
    finally:
        up.stop()
    total = sum(counts)
    print(f"gateway relay: {total} chunks in {wall:.1f} s wall ({total / wall:.0f}/s, bounded by the worker); "
          f"gateway CPU {cpu:.2f} s -> {total / max(cpu, 1e-9):.0f} chunks per CPU-second (one chunk per token)")


def engine_batch(streams: int, tokens: int, threads: int) -> float:
    """Tokens/s of the in-process engine running `streams` requests of `tokens` tokens together (best of 2)."""
    eng = Engine.from_pretrained("builtin", EngineConfig(num_threads=threads, max_num_seqs=streams,
                                                          enable_prefix_caching=False))
    best = 0.0
    for rep in range(3):
        for k in range(streams):
            eng.add_request(f"b{rep}-{k}", eng.tokenizer.encode(f"{k} {PROMPT}"),
                            SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
        t0 = time.perf_counter()
        while eng.has_unfinished():
            eng.step()
        if rep:  # the first round warms up
            best = max(best, streams * tokens / (time.perf_counter() - t0))
    return best


def decode_throughput(streams: int, tokens: int) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PDSERVE_LOG_LEVEL="WARNING")
    up = UpProcess(["--model", "builtin", "--mode", "disagg", "--prefill", "1", "--decode", "1", "--threads", "1",
                    "--max-num-seqs", str(streams)], env, 180)
    try:
        dec = up.workers("decode")[0]["pid"]
        body = {"model": "builtin", "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
        stream_ttft(up.base_url, {**body, "max_tokens": 8})
        rates, cpus, loops = [], [], []
        for rep in range(2):
            done = [0] * streams

            def client(k: int) -> None:
                done[k] = stream_ttft(up.base_url, {**body, "prompt": f"{rep} {k} {PROMPT}"})[1].get(
                    "completion_tokens", 0)

            c0, l0, t0 = cpu_seconds(dec), cpu_seconds(dec, dec), time.perf_counter()
            run_clients(streams, client)
            wall, cpu, loop = time.perf_counter() - t0, cpu_seconds(dec) - c0, cpu_seconds(dec, dec) - l0
            n = max(sum(done), 1)
            rates.append(sum(done) / wall)
            cpus.append(cpu / n)
            loops.append(loop / n)
    finally:
        up.stop()
    eng = engine_batch(streams, tokens, 1)
    served = max(rates)
    # on a small box the clients here, the gateway and the workers share the cores: the tokens/s ratio then says
    # as much about the machine as about the server; the CPU per token is the decode worker's own cost
    print(f"decode throughput, {streams} streams x {tokens} tokens, 1 thread: served {served:.0f} tok/s, "
          f"engine-only {eng:.0f} tok/s -> {served / eng:.2f}x (clients, gateway and workers share "
          f"{os.cpu_count()} cpus)")
    print(f"  decode worker CPU {min(cpus) * 1e3:.3f} ms/token (event-loop thread {min(loops) * 1e3:.3f}) vs the "
          f"engine alone {1e3 / eng:.3f} ms/token")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--only", choices=("overhead", "relay", "decode"), default=None)
    a = ap.parse_args()
    from pdserve.engine import cpu_isa
    print(f"cpu: {cpu_isa.cpu_model()}; level: {cpu_isa.detected_level()}; {os.cpu_count()} cpus")
    if a.only in (None, "overhead"):
        overhead(a.requests)
    if a.only in (None, "relay"):
        relay(a.streams, a.tokens)
    if a.only in (None, "decode"):
        decode_throughput(a.streams, max(a.tokens, 200))


if __name__ == "__main__":
    main()
