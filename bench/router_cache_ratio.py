"""Cache-aware placement with 2 active-active routers vs 1: cached prompt tokens / prompt tokens, one run each.

`pdserve up --mode colocated --workers 2 --routers R` plus a second gateway started here on the same Redis. With
R = 2 the two gateways ask different routers (`up`'s gateway `router`, the second `router-1`: what a Service
spreading gateways over the router replicas does); with R = 1 both ask the one router. The workload is multi-turn
chats (a system prompt per chat, then user / assistant turns carrying the whole conversation), each chat's turns
alternating between the two gateways, so a turn's prefix was placed by the *other* router's view the turn before.
The ratio is the sum of `usage.prompt_tokens_details.cached_tokens` over the sum of `usage.prompt_tokens`, over
turns 2.. (turn 1 of a chat has nothing to hit but its system prompt's blocks if another chat shared them; none do
here). A turn's placement is read from `x-pdserve-route` (the worker chosen), to say whether a chat stayed on one
worker.

    python bench/router_cache_ratio.py [--chats 6] [--turns 5] [--concurrency 1]
"""
from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from pdserve.services.ports import free_port  # noqa: E402
from pdserve.services.up_process import UpProcess  # noqa: E402

WORDS = ("river stone maple copper lantern harbor meadow signal orbit velvet cedar prism falcon ember quartz "
         "willow beacon summit canyon thistle").split()
ENGINE = ["--threads", "1", "--num-gpu-blocks", "512"]


def text(seed: int, n: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 3 + i * i) % len(WORDS)] for i in range(n))


class Deployment:
    """`up` with R routers and a second gateway on router-1 (R = 2) or the one router (R = 1)."""

    def __init__(self, routers: int):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PDSERVE_LOG_LEVEL": "WARNING"}
        self.up = UpProcess(["--model", "builtin", "--mode", "colocated", "--workers", "2", "--routers",
                             str(routers), *ENGINE], env, 240)
        addr = [f"127.0.0.1:{p['port']}" for p in self.up.info["processes"] if p["name"].startswith("router")]
        mine = addr[1:] + addr[:1]  # the second gateway prefers the other router (the last that answered: the first)
        port = free_port()
        self.gw = subprocess.Popen([sys.executable, "-m", "pdserve", "gateway", "--model", "builtin", "--port",
                                    str(port), "--router", ",".join(mine), "--redis-url", self.up.info["redis_url"],
                                    *self.up.security_flags()], env=env, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        self.urls = [self.up.base_url, f"http://127.0.0.1:{port}"]
        end = time.monotonic() + 120
        while time.monotonic() < end:
            try:
                if httpx.get(self.urls[1] + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            self.close()
            raise RuntimeError("the second gateway did not become ready")

    def close(self) -> None:
        if self.gw.poll() is None:
            self.gw.terminate()
            try:
                self.gw.wait(30)
            except subprocess.TimeoutExpired:
                self.gw.kill()
                self.gw.wait()
        self.up.stop()


def turn(url: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"model": "builtin", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers={"x-pdserve-debug": "route"}, timeout=120)
    r.raise_for_status()
    j = r.json()
    last = r.headers.get("x-pdserve-route", "").split(" | ")[-1]
    route = dict(kv.split("=", 1) for kv in last.split(";") if "=" in kv)
    u = j["usage"]
    return {"text": j["choices"][0]["message"]["content"], "prompt": u["prompt_tokens"],
            "cached": (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0), "route": route}


def chat(dep: Deployment, c: int, turns: int, max_tokens: int) -> list[dict]:
    convo, rows = [{"role": "system", "content": text(100 + c, 120)}], []
    for t in range(turns):
        convo.append({"role": "user", "content": text(10 * c + t, 30)})
        res = turn(dep.urls[(c + t) % 2], convo, max_tokens)
        convo.append({"role": "assistant", "content": res["text"]})
        rows.append(res)
    return rows


def run(dep: Deployment, chats: int, turns: int, max_tokens: int, concurrency: int) -> list[list[dict]]:
    """Each chat's turns in order; `concurrency` chats at once (the routers' load estimates then matter)."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(concurrency) as ex:
        return list(ex.map(lambda c: chat(dep, c, turns, max_tokens), range(chats)))


def summary(rows: list[list[dict]]) -> dict:
    later = [r for chat in rows for r in chat[1:]]
    workers = [{r["route"].get("worker") for r in chat} for chat in rows]
    return {"ratio": sum(r["cached"] for r in later) / max(1, sum(r["prompt"] for r in later)),
            "cached": sum(r["cached"] for r in later), "prompt": sum(r["prompt"] for r in later),
            "predicted": sum(int(r["route"].get("cached_tokens", 0)) for r in later),
            "moved": sum(len(w) > 1 for w in workers), "texts": [[r["text"] for r in chat] for chat in rows]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chats", type=int, default=6)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=1, help="chats in flight at once")
    a = ap.parse_args()
    res = {}
    for routers in (1, 2):
        dep = Deployment(routers)
        try:
            for url in dep.urls:
                turn(url, [{"role": "user", "content": "warm up"}], 2)
            res[routers] = summary(run(dep, a.chats, a.turns, a.max_tokens, a.concurrency))
        finally:
            dep.close()
    print(f"CPU: {platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; builtin model, "
          f"colocated, 2 workers, 2 gateways; {a.chats} chats x {a.turns} turns ({a.concurrency} at once), turns "
          "alternating gateways")
    print("| routers | cached / prompt tokens, turns 2.. | the routers' predicted hits | chats placed on more than "
          "one worker |")
    print("| --- | --- | --- | --- |")
    for routers, s in res.items():
        print(f"| {routers} | {s['cached']} / {s['prompt']} = {s['ratio']:.3f} | {s['predicted']} | "
              f"{s['moved']} of {a.chats} |")
    print("answers equal (1 vs 2 routers):", res[1]["texts"] == res[2]["texts"])


if __name__ == "__main__":
    main()
