"""Cancelled streams leave no KV behind (storm) and a busy worker stays registered (heartbeat), through a whole
deployment (`pdserve up --mode disagg --model builtin`).

    python bench/worker_cleanup.py storm [--requests 60] [--concurrency 4] [--stage first|random]
    python bench/worker_cleanup.py heartbeat [--clients 6] [--seconds 30] [--prompt-tokens 800]

storm: streaming requests (150-word prompt, max_tokens 128, ignore_eos), each socket closed right after the first
`data:` event (`--stage first`: the KV transfer window) or at a random stage (`--stage random`: after 0-300 ms,
before or after the first token, or after 1-5 events). Then each worker's blocks in use, blocks pinned under
leases and live requests, read exactly with the GetStats RPC, 0.5 s / 2 s / 10 s after the last close.
heartbeat: closed-loop clients with ~800-token prompts; the registry entry of every worker is polled every 100 ms
in Redis: lapses (present -> absent) are counted, and so are the gateway's "no serving workers"/"no placement"
rejections.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.services.grpc_util import channel  # noqa: E402
from pdserve.services.pb import worker_pb2, worker_pb2_grpc  # noqa: E402
from pdserve.services.registry import workers_key  # noqa: E402
from pdserve.services.up_process import UpProcess  # noqa: E402

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex every jolly vexing sphinx of "
         "black quartz judge my vow and pack my box with five dozen liquor jugs").split()


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def held(up: UpProcess) -> list[tuple[str, int, int, dict]]:
    out = []
    for w in up.workers():
        st = await worker_pb2_grpc.WorkerStub(channel(f"127.0.0.1:{w['port']}")).GetStats(
            worker_pb2.GetStatsRequest(), metadata=up.grpc_metadata(), timeout=10)
        out.append((w["name"], st.load.kv_blocks_in_use, st.load.pinned_blocks, dict(st.states)))
    return out


def storm(args) -> None:
    up = UpProcess(["--model", "builtin", "--mode", "disagg", "--lease-ttl", str(args.lease_ttl)])
    try:
        rng = random.Random(1)
        sem = threading.Semaphore(args.concurrency)
        outcome: dict[str, int] = {}
        lock = threading.Lock()

        def one(i: int) -> None:
            body = {"model": "builtin", "prompt": words(150, i), "max_tokens": 128, "ignore_eos": True,
                    "stream": True}
            with lock:
                stage = "first" if args.stage == "first" else rng.choice(["delay", "first", "events"])
                delay, events = rng.uniform(0, 0.3), rng.randint(1, 5)
            t0 = time.monotonic()
            n = 0
            try:
                with httpx.stream("POST", up.base_url + "/v1/completions", json=body, timeout=60) as r:
                    for line in r.iter_lines():
                        if stage == "delay" and time.monotonic() - t0 >= delay:
                            break
                        if line.startswith("data: ") and line != "data: [DONE]":
                            n += 1
                            if stage == "first" or n >= events:
                                break
                key = f"{stage}:{r.status_code}"
            except httpx.HTTPError as e:
                key = f"{stage}:{type(e).__name__}"
            with lock:
                outcome[key] = outcome.get(key, 0) + 1

        def worker(ids):
            for i in ids:
                with sem:
                    one(i)

        t0 = time.monotonic()
        threads = [threading.Thread(target=worker, args=(range(k, args.requests, args.concurrency),))
                   for k in range(args.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        t_end = time.monotonic()
        print(f"{args.requests} streams, {args.concurrency} at a time, closed at stage {args.stage!r} in "
              f"{t_end - t0:.1f}s: {outcome}")
        for at in (0.5, 2.0, 10.0):
            time.sleep(max(0.0, t_end + at - time.monotonic()))
            print(f"  +{at:>4}s (worker, blocks in use, blocks pinned under leases, live requests):",
                  asyncio.run(held(up)))
    finally:
        up.stop()


def heartbeat(args) -> None:
    up = UpProcess(["--model", "builtin", "--mode", "disagg"])
    try:
        r = up.redis()
        keys = {w["worker_id"]: workers_key("builtin", w["worker_id"]) for w in up.workers()}
        lapses = {wid: 0 for wid in keys}
        stop = threading.Event()

        def watch():
            present = {wid: True for wid in keys}
            while not stop.is_set():
                for wid, k in keys.items():
                    now = bool(r.exists(k))
                    if present[wid] and not now:
                        lapses[wid] += 1
                    present[wid] = now
                time.sleep(0.1)

        codes: dict[str, int] = {}
        lock = threading.Lock()
        from pdserve.builtin import builtin_model_dir
        from pdserve.engine.tokenizer import Tokenizer
        tok = Tokenizer(builtin_model_dir(), [])
        ratio = len(tok.encode(words(1000, 0))) / 1000  # builtin tokens per word of this vocabulary (~1.7)
        prompt_words = int(args.prompt_tokens / ratio)
        end = time.monotonic() + args.seconds

        def client(c: int):
            i = 0
            while time.monotonic() < end:
                i += 1
                body = {"model": "builtin", "prompt": words(prompt_words, c * 100000 + i), "max_tokens": 32,
                        "ignore_eos": True}
                try:
                    resp = httpx.post(up.base_url + "/v1/completions", json=body, timeout=60)
                    key = str(resp.status_code)
                    if resp.status_code == 503 and ("no serving workers" in resp.text or "no placement" in resp.text):
                        key = "503 no workers"
                    elif resp.status_code == 200 and c == 0 and i == 1:
                        print("prompt tokens:", resp.json()["usage"]["prompt_tokens"])
                    elif resp.status_code != 200 and key not in codes:
                        print(key, resp.text[:200])
                except httpx.HTTPError as e:
                    key = type(e).__name__
                with lock:
                    codes[key] = codes.get(key, 0) + 1

        w = threading.Thread(target=watch)
        w.start()
        clients = [threading.Thread(target=client, args=(c,)) for c in range(args.clients)]
        for t in clients:
            t.start()
        for t in clients:
            t.join()
        stop.set()
        w.join()
        print(f"{args.clients} clients x ~{args.prompt_tokens}-token prompts for {args.seconds}s: responses {codes}; "
              f"registry lapses per worker {lapses}")
    finally:
        up.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("storm")
    s.add_argument("--requests", type=int, default=60)
    s.add_argument("--concurrency", type=int, default=4)
    s.add_argument("--stage", choices=["first", "random"], default="first")
    s.add_argument("--lease-ttl", type=float, default=30.0)
    h = sub.add_parser("heartbeat")
    h.add_argument("--clients", type=int, default=6)
    h.add_argument("--seconds", type=float, default=30.0)
    h.add_argument("--prompt-tokens", type=int, default=800)
    args = ap.parse_args()
    storm(args) if args.cmd == "storm" else heartbeat(args)


if __name__ == "__main__":
    main()
