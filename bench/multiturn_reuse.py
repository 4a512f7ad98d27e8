"""Decode-side prefix reuse on a multi-turn chat: KV bytes pulled and TTFT per turn, reuse on vs off, one run.

Two disaggregated deployments of the built-in model (1 prefill + 1 decode worker each) run side by side: one as
shipped, one with `--no-decode-prefix-reuse` (every prompt block pulled). The same chats go to both, turn by turn,
alternating which deployment goes first. Each turn is a streamed /v1/chat/completions call carrying the whole
conversation so far (a system prompt, then user and assistant messages); TTFT is the time to the first content
chunk (in disaggregated serving the prefill worker's first token goes out ahead of the pull, so the pull shows
in the time to the second chunk and in the decode worker's pdserve_kv_transfer_seconds); bytes and blocks are the
decode worker's pdserve_kv_transfer_bytes_total / pdserve_kv_pull_blocks_total /
pdserve_kv_pull_reused_blocks_total deltas around the call (calls are sequential). docs/kv_transfer.md.

    python bench/multiturn_reuse.py [--chats 4] [--turns 5] [--link 40mbit]

Without `--link` the deployments are `pdserve up --mode disagg` on this host (NIXL over shared memory: a memcpy).
With it they are `pdserve lab` clusters (root; emulated hosts, UCX over TCP on links shaped to that rate).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from pdserve.services.up_process import UpProcess  # noqa: E402
from tests.e2e.conftest import samples  # noqa: E402

WORDS = ("river stone maple copper lantern harbor meadow signal orbit velvet cedar prism falcon ember quartz "
         "willow beacon summit canyon thistle").split()
COUNTERS = ("pdserve_kv_transfer_bytes_total", "pdserve_kv_pull_blocks_total", "pdserve_kv_pull_reused_blocks_total",
            "pdserve_kv_transfer_seconds_sum")
ENGINE = ["--threads", "1", "--num-gpu-blocks", "512"]


def text(seed: int, n: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 3 + i * i) % len(WORDS)] for i in range(n))


class Local:
    def __init__(self, extra: tuple[str, ...]):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PDSERVE_LOG_LEVEL": "WARNING"}
        self.up = UpProcess(["--model", "builtin", "--mode", "disagg", "--prefill", "1", "--decode", "1",
                             *ENGINE, *extra], env, 240)
        self.base_url = self.up.base_url

    def metrics(self) -> list[str]:
        return [f"http://127.0.0.1:{w['metrics_port']}/metrics" for w in self.up.workers("decode")]

    def close(self) -> None:
        self.up.stop()


class Lab:
    def __init__(self, extra: tuple[str, ...], link: str, tag: str):
        from pdserve.lab.cluster import LabCluster, LabSpec
        from pdserve.lab.netns import Link
        self.c = LabCluster(LabSpec(link=Link.parse(link), engine_args=(*ENGINE, *extra),
                                    env={"PYTHONPATH": str(ROOT), "PDSERVE_LOG_LEVEL": "WARNING"}), tag=tag)
        self.c.start()
        self.base_url = self.c.base_url

    def metrics(self) -> list[str]:
        return [self.c.metrics_url(h) for h in self.c.workers if h.startswith("decode")]

    def close(self) -> None:
        self.c.close()


def counters(dep) -> list[float]:
    got = [httpx.get(u, timeout=10).text for u in dep.metrics()]
    return [sum(sum(samples(t, name)) for t in got) for name in COUNTERS]


def turn(dep, messages: list[dict], max_tokens: int) -> dict:
    """One streamed chat turn: answer text, TTFT, and the decode side's bytes / blocks pulled / blocks reused."""
    before = counters(dep)
    body = {"model": "builtin", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    t0, stamps, parts = time.perf_counter(), [], []
    with httpx.stream("POST", dep.base_url + "/v1/chat/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for ch in json.loads(line[6:]).get("choices", []):
                if ch.get("delta", {}).get("content"):
                    stamps.append(time.perf_counter() - t0)
                    parts.append(ch["delta"]["content"])
    time.sleep(0.05)  # the counters move when the pull ends, before the first token: already there
    after = counters(dep)
    d = [a - b for a, b in zip(after, before)]
    return {"text": "".join(parts), "ttft": stamps[0], "t2": stamps[1], "bytes": d[0], "pulled": d[1],
            "reused": d[2], "pull_s": d[3]}


def run(deps: dict, chats: int, turns: int, max_tokens: int) -> dict:
    """rows[name][turn] = the per-chat results, the deployments taking turns in alternating order."""
    rows = {n: [[] for _ in range(turns)] for n in deps}
    for c in range(chats):
        convo = {n: [{"role": "system", "content": text(100 + c, 120)}] for n in deps}
        for t in range(turns):
            for n in (list(deps) if (c + t) % 2 == 0 else list(deps)[::-1]):
                convo[n].append({"role": "user", "content": text(10 * c + t, 30)})
                res = turn(deps[n], convo[n], max_tokens)
                convo[n].append({"role": "assistant", "content": res["text"]})
                rows[n][t].append(res)
    return rows


def report(rows: dict, chats: int, turns: int, label: str) -> None:
    differ = [sum(a["text"] != b["text"] for a, b in zip(rows["on"][t], rows["off"][t])) for t in range(turns)]
    print(f"CPU: {platform.processor() or platform.machine()}, {_cpu_model()}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}; {label}; {chats} chats x {turns} turns")
    print("| turn | KV pulled, reuse off | on | blocks reused (on) | KV pull, off | on | TTFT, off | on "
          "| 2nd token, off | on |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for t in range(turns):
        off, on = rows["off"][t], rows["on"][t]
        print(f"| {t + 1} | {_mean(off, 'bytes') / 1024:.0f} KiB | {_mean(on, 'bytes') / 1024:.0f} KiB | "
              f"{_mean(on, 'reused'):.1f} | " + " | ".join(f"{_med(rs, k) * 1000:.1f} ms" for k in
                                                         ("pull_s", "ttft", "t2") for rs in (off, on)) + " |")
    tot = {n: sum(r["bytes"] for tr in rows[n] for r in tr) for n in rows}
    print(f"total KV bytes pulled: off {tot['off'] / 2**20:.2f} MiB, on {tot['on'] / 2**20:.2f} MiB "
          f"({tot['on'] / max(1.0, tot['off']):.2f}x); chats whose answers differ (on vs off), per turn: "
          f"{differ} of {chats}")


def _mean(rs: list[dict], k: str) -> float:
    return statistics.fmean(r[k] for r in rs)


def _med(rs: list[dict], k: str) -> float:
    return statistics.median(r[k] for r in rs)


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chats", type=int, default=4)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--deterministic", action="store_true",
                    help="both deployments batch-invariant: a cache hit changes no bit, so on and off must agree")
    ap.add_argument("--link", default="", help="run on emulated hosts with links of this rate (e.g. 40mbit)")
    a = ap.parse_args()
    if a.deterministic:
        ENGINE.append("--deterministic")
    label = f"link {a.link} (emulated hosts, UCX over TCP; on, then off)" if a.link \
        else "one host (NIXL over shared memory; on and off side by side)"
    label += ", --deterministic" if a.deterministic else ""
    rows: dict = {}
    # on one host both deployments run at once, alternating turns; the emulated hosts of two labs would share
    # one subnet, so there each runs the trace in turn
    for names in ([("on", "off")] if not a.link else [("on",), ("off",)]):
        deps = {}
        try:
            for name in names:
                extra = ("--no-decode-prefix-reuse",) if name == "off" else ()
                deps[name] = Lab(extra, a.link, f"mt{name}") if a.link else Local(extra)
                turn(deps[name], [{"role": "user", "content": "warm up"}], 4)  # first pull: the peers' handshake
            rows.update(run(deps, a.chats, a.turns, a.max_tokens))
        finally:
            for d in deps.values():
                d.close()
    report(rows, a.chats, a.turns, label)

if __name__ == "__main__":
    main()
